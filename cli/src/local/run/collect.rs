//! After training: the workers' accounts, the shards' counters, the replica sets, the dealer's account and
//! the final model's evaluation, into the report.

use super::*;

/// The workers' own accounts, summed.
#[derive(Default)]
struct WorkerTotals {
    steps: u64,
    pushes_sent: u64,
    pushes_acknowledged: u64,
    stale_after_restore: u64,
    retries: u64,
    samples: u64,
    bad_lines: u64,
    epochs: f64,
    /// The first finished worker's held-out curve: (step, epochs, log-loss, AUC).
    heldout_curve: Vec<(u64, f64, f64, f64)>,
    stopped_early: u32,
    workers_final: u32,
    pushes_unconfirmed: u64,
    /// Per worker (its id when known), the pushes it saw acknowledged by each shard.
    acknowledged_by: Vec<(Option<u32>, Vec<u64>)>,
}

impl WorkerTotals {
    /// Reads each worker's output: a killed worker's last ledger line, a finished worker's summary.
    fn of(workers: &[Proc], outputs: &[String], killed: &[usize], per_step: u64) -> Result<WorkerTotals> {
        let mut t = WorkerTotals::default();
        for (i, (p, text)) in workers.iter().zip(outputs).enumerate() {
            if killed.contains(&i) {
                // Its ledger up to the last step it finished; the step it was in when killed may have sent
                // up to a step's pushes that nobody saw acknowledged (applied or not). A line cut short by
                // the kill is not a ledger line.
                let last = text.lines().rev().find_map(|l| serde_json::from_str::<PushLedger>(l).ok());
                if let Some(l) = last {
                    t.pushes_sent += l.pushes_sent;
                    t.pushes_acknowledged += l.pushes_acknowledged;
                    t.stale_after_restore += l.stale_after_restore;
                    t.acknowledged_by.push((l.worker, l.acknowledged_by_shard));
                }
                t.pushes_unconfirmed += per_step;
                continue;
            }
            t.workers_final += 1;
            let line = text
                .lines()
                .rev()
                .find(|l| l.contains("worker_done"))
                .with_context(|| format!("{} printed no summary", p.name))?;
            let w: WorkerSummary =
                serde_json::from_str(line).with_context(|| format!("{}'s summary {line:?}", p.name))?;
            t.steps += w.steps;
            t.pushes_sent += w.pushes_sent;
            t.pushes_acknowledged += w.pushes_acknowledged;
            t.acknowledged_by.push((Some(w.worker), w.acknowledged_by_shard));
            t.stale_after_restore += w.stale_after_restore;
            t.retries += w.retries;
            t.samples += w.samples;
            // A fixed share is read from the whole file (every worker meets every bad line); dealt splits are
            // read by one worker each (first pass only).
            t.bad_lines = match w.data_sharding {
                DataSharding::Dynamic => t.bad_lines + w.bad_lines,
                DataSharding::Static => t.bad_lines.max(w.bad_lines),
            };
            t.epochs = t.epochs.max(w.epochs);
            t.stopped_early += u32::from(w.stopped_early);
            if t.heldout_curve.is_empty() {
                t.heldout_curve = w.heldout_curve.iter().map(|p| (p.step, p.epochs, p.logloss, p.auc)).collect();
            }
        }
        Ok(t)
    }
}

/// After training: the workers' accounts, the shards' counters, the replica sets, the dealer's account and
/// the final model's evaluation, into the report.
pub(super) async fn collect(
    launch: &Launch<'_>,
    procs: &Procs,
    supervisor: Supervisor,
    observer: Client,
    eval: &Evaluation,
    initial_loss: f32,
) -> Result<LocalReport> {
    let args = launch.args;
    let Supervisor { outputs, killed, failover_watches, mut checkpoints_seen, timeline, .. } = supervisor;
    let outputs: Vec<String> = outputs.into_iter().map(Option::unwrap_or_default).collect();
    let training_s = supervisor.training_started.elapsed().as_secs_f64();
    if let Some(path) = &args.step_log {
        let lines = merge_step_logs(launch.dir, procs.workers.len() as u32, path)?;
        eprintln!("[gaps local] {lines} step times of {} workers written to {}", procs.workers.len(), path.display());
    }
    let totals = WorkerTotals::of(&procs.workers, &outputs, &killed, launch.pushes_per_step())?;
    let stats = observer.stats().await.context("reading shard counters")?;
    let replication = replication_report(args, &observer, &stats, failover_watches).await;
    let data = data_report(args, &observer).await?;
    let (final_loss, ctr) = match &eval.ctr {
        Some((shape, held)) => {
            let (logloss, auc) =
                evaluate(&observer, shape, &held.samples).await.context("evaluating the final model")?;
            let mut timeline = timeline;
            timeline.push((training_s, auc, logloss));
            let report = ctr_report(&totals, &stats, held, (logloss, auc), training_s, timeline);
            (logloss as f32, Some(report))
        }
        None => {
            let final_model = observer.pull().await.context("pulling the final model")?;
            (eval_loss(&eval.data, &final_model.tensors, args.eval_samples), None)
        }
    };
    observer.close().await;
    if let Some(d) = &launch.checkpoint_dir {
        checkpoints_seen.extend(checkpoint_files(d));
    }
    let count: u64 = stats.iter().map(|s| s.staleness_count).sum();
    let pushes_applied: u64 = stats.iter().map(|s| s.pushes_applied).sum();
    let (switches, switches_agree) = switches_of(&stats);
    let counters = RunCounters {
        initial_loss,
        final_loss,
        steps: totals.steps,
        pushes_sent: totals.pushes_sent,
        pushes_applied,
        pushes_duplicate: stats.iter().map(|s| s.pushes_duplicate).sum(),
        retries: totals.retries,
        staleness_mean: stats.iter().map(|s| s.staleness_sum).sum::<u64>() as f64 / count.max(1) as f64,
        staleness_max: stats.iter().map(|s| s.staleness_max).max().unwrap_or(0),
        wall_s: 0.0,
        mode_switches: stats.first().map_or(0, |s| s.mode_switches),
        switches_agree,
        steps_sync: stats.first().map_or(0, |s| s.steps_sync),
        steps_gba: stats.first().map_or(0, |s| s.steps_gba),
        workers_final: totals.workers_final,
        dropped_stale: stats.iter().map(|s| s.dropped_stale).sum(),
        pushes_dropped_at_switch: stats.iter().map(|s| s.pushes_dropped_at_switch).sum(),
        lr_multiplier_final: stats.first().map_or(1.0, |s| f64::from(s.lr_multiplier_milli) / 1000.0),
        shard_restarts: supervisor.shard_restarts,
        checkpoints_written: checkpoints_seen.len() as u64,
        restored_version: supervisor.restored_version,
        pushes_acknowledged: totals.pushes_acknowledged,
        pushes_lost: pushes_lost(&totals.acknowledged_by, &stats),
        pushes_applied_twice: stats.iter().map(|s| s.pushes_applied_twice).sum(),
        pushes_unconfirmed: totals.pushes_unconfirmed,
        longest_step_s: Duration::from_micros(procs.longest_step_us.load(Ordering::Relaxed)).as_secs_f64(),
        stale_after_restore: totals.stale_after_restore,
    };
    Ok(LocalReport { servers: args.servers, workers: args.workers, ctr, switches, replication, data, counters })
}

/// The CTR figures of the report.
fn ctr_report(
    totals: &WorkerTotals,
    stats: &[gaps_common::wire::Stats],
    held: &gaps_models::criteo::HeldOut,
    (logloss, auc): (f64, f64),
    training_s: f64,
    timeline: Vec<(f64, f64, f64)>,
) -> CtrReport {
    let labels: Vec<u8> = held.samples.iter().map(|s| s.label).collect();
    CtrReport {
        auc,
        teacher_auc: held.teacher.as_ref().map(|p| gaps_models::criteo::auc(p, &labels)),
        logloss,
        samples_per_s: totals.samples as f64 / training_s.max(1e-9),
        bad_lines: totals.bad_lines.max(held.bad_lines),
        table_rows: stats.iter().map(|s| s.table_rows).sum(),
        table_bytes: stats.iter().map(|s| s.table_bytes).sum(),
        epochs: totals.epochs,
        constant_logloss: constant_logloss(&labels),
        rows_dropped_stale: stats.iter().map(|s| s.rows_dropped_stale).sum(),
        heldout_curve: totals.heldout_curve.clone(),
        stopped_early: totals.stopped_early,
        timeline,
    }
}

/// The coordinator's replica sets at the end, as far as it answers (a run whose training finished is not
/// failed for want of them), with each killed shard's fail-over time.
async fn replication_report(
    args: &LocalArgs,
    observer: &Client,
    stats: &[gaps_common::wire::Stats],
    failover_watches: Vec<JoinHandle<Option<f64>>>,
) -> Option<ReplicationReport> {
    let map = if args.replicas > 1 {
        match observer.current_map().await {
            Ok(map) => Some(map),
            Err(e) => {
                eprintln!("[gaps local] could not read the coordinator's replica sets for the summary: {e}");
                None
            }
        }
    } else {
        None
    };
    let Some(map) = map else {
        failover_watches.iter().for_each(JoinHandle::abort);
        return None;
    };
    let mut report = ReplicationReport::from_map(&map);
    report.replica_lag_peak = stats.iter().map(|s| s.replica_lag_peak).collect();
    report.rereplication = stats.iter().map(|s| s.replica_copies.iter().map(CopyReport::of).collect()).collect();
    // A fail-over still under way when training ended gets 10 s more to finish.
    for mut watch in failover_watches {
        let took = tokio::time::timeout(Duration::from_secs(10), &mut watch).await;
        watch.abort();
        report.failover_s.push(took.ok().and_then(|r| r.ok()).flatten());
    }
    Some(report)
}

/// The data dealer's account at the end (dynamic sharding only), its whole state written to
/// `--data-status-out` when asked.
async fn data_report(args: &LocalArgs, observer: &Client) -> Result<Option<DataReport>> {
    if !args.deals_data() {
        return Ok(None);
    }
    let status = observer.data_status().await.context("reading the data dealer's state")?;
    if let Some(out) = &args.data_status_out {
        write_data_status(out, &status)?;
    }
    Ok(status.first().and_then(|s| s.dealer.as_ref()).map(|d| DataReport {
        splits_done: d.splits_done,
        splits_per_epoch: d.splits_per_epoch,
        splits_returned: d.splits_returned,
        splits_pending: d.splits_pending,
        samples_replayed: d.samples_replayed,
        finished: d.finished,
    }))
}

/// The coordinator's mode switches (printed as they are read), and whether every shard carried out the
/// same switches at the same worker steps (as far as each remembers).
fn switches_of(stats: &[gaps_common::wire::Stats]) -> (Vec<gaps_common::wire::ModeSwitchRecord>, bool) {
    let switches = stats.first().map(|s| s.switches.clone()).unwrap_or_default();
    let key = |s: &gaps_common::wire::ModeSwitchRecord| (s.number, s.from, s.to, s.from_step);
    let switches_agree = stats.iter().all(|st| {
        let theirs: Vec<_> = st.switches.iter().map(key).collect();
        let ours: Vec<_> = switches.iter().map(key).filter(|k| theirs.first().is_none_or(|f| k.0 >= f.0)).collect();
        theirs == ours
    });
    for s in &switches {
        eprintln!(
            "[gaps local] mode switch {}: {} -> {} from worker step {} ({})",
            s.number,
            mode_name(s.from),
            mode_name(s.to),
            s.from_step,
            s.reason
        );
    }
    (switches, switches_agree)
}
