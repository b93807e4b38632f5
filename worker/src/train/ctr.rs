//! The CTR models' training loop (`--model ctr`, `deepfm`, …): dense values and embedding rows pulled
//! per step, gradients pushed, the next batch read while the pushes are on the wire, held-out evaluation.

use super::*;

/// The CTR training loop: per step, the next batch, its distinct ids; dense and sparse pulls together;
/// forward/backward; dense and sparse pushes together.
pub(super) async fn run_ctr(
    args: &WorkerArgs,
    client: crate::Client,
    worker: u32,
    model: crate::recsys::CtrModel,
) -> Result<WorkerSummary> {
    use crate::recsys::{forward, CtrShape};
    let shape = CtrShape::from_layout(model, client.layout()).map_err(anyhow::Error::msg)?;
    let (data, (part, parts)) = ctr_data(args, worker);
    let (step_limit, epochs) = args.limits();
    let fixed = || crate::feed::Feed::fixed(&data, part, parts, epochs);
    let mut feed = match args.data_sharding {
        DataSharding::Static => fixed()?,
        DataSharding::Dynamic => dealt_feed(args, &data, epochs, worker),
    };
    let held = (args.eval_every > 0)
        .then(|| crate::criteo::held_out(&data, args.eval_samples as usize).map(|h| h.samples))
        .transpose()
        .map_err(anyhow::Error::msg)?;
    let mut curve = Vec::new();
    let mut early = EarlyStop::new(args.patience);
    let mut stopped_early = false;
    info!(worker, model = args.model.name(), row_dim = shape.row_dim(), "joined the cluster");
    let lease = Duration::from_millis(u64::from(client.map().lease_ms));
    let heartbeats = client.start_heartbeats((lease / 3).max(Duration::from_millis(100)))?;
    let mut step_log = StepLog::open(args.step_log.as_deref(), worker)?;
    let started = Instant::now();
    let mut losses = Vec::with_capacity(step_limit.unwrap_or(1024).min(1 << 20) as usize);
    let mut samples_seen = 0u64;
    let mut logits = Vec::new();
    // A step goes as one request per shard and brings back the next batch's rows: that batch is read a step
    // ahead (`push_ctr_step`). A dealt split's last batch is followed by a request for the next split, made
    // once its pushes are acknowledged (so a split is reported finished only when all of it is in the model).
    let prepare = indexed;
    let more = |step: u64| step_limit.is_none_or(|n| step < n);
    let n = args.batch as usize;
    let mut next = if more(0) {
        Some(prepare(first_batch(&mut feed, &client, n, fixed, (worker, part, parts)).await?))
    } else {
        None
    };
    let mut step = 0u64;
    // The batch after `next` if read (while the last step was on the wire), and what the last step brought.
    let mut ahead: Option<Result<Option<Prepared>>> = None;
    let mut pulled: Option<(crate::client::Snapshot, Option<crate::client::SparseRows>)> = None;
    // The feed ends with an empty batch once the data is used up (--epochs, or the dealer's last split).
    while let Some((crate::feed::Batch { samples, tag }, batch)) = next.take().filter(|(b, _)| !b.samples.is_empty()) {
        client.set_data_tag(tag);
        samples_seen += samples.len() as u64;
        let (step_started, waited_before) = (Instant::now(), client.waited());
        let (dense, rows) = step_inputs(&client, pulled.take(), &batch.ids).await?;
        let compute = Instant::now();
        let mut dense_grads: Vec<Vec<f32>> = dense.tensors.iter().map(|t| vec![0.0; t.len()]).collect();
        let mut row_grads = vec![0.0f32; rows.values.len()];
        let loss = forward(
            &shape,
            &dense.tensors,
            &rows.values,
            &batch,
            &samples,
            &mut logits,
            Some((&mut dense_grads, &mut row_grads)),
        );
        losses.push(loss / samples.len().max(1) as f32);
        emulate_compute(args, started, compute.elapsed()).await;
        let last = !more(step + 1);
        let prepared;
        (pulled, prepared) = push_ctr_step(
            &client,
            (dense_grads, &dense),
            (&rows, &row_grads),
            (&mut feed, &mut ahead),
            (n, last, more(step + 2)),
            step,
        )
        .await?;
        // The step as the simulator replays it: pulls, compute and pushes, not the waits for a synchronous
        // step (which would make every worker as slow as the slowest).
        step_log.record(step_started.elapsed().saturating_sub(client.waited().saturating_sub(waited_before)));
        dense.recycle();
        let dropped = feed.follow_rollbacks(&client);
        next = match prepared? {
            // The cluster went back to a checkpoint since the split was dealt: its batch is not trained.
            Some(_) if dropped && !last => {
                ahead = None;
                Some(prepare(feed.next_dealt(&client, n).await?))
            }
            Some(batch) => Some(batch),
            None if last => None,
            None => Some(prepare(feed.next_dealt(&client, n).await?)),
        };
        step += 1;
        ledger_line(args, &client, step);
        if step_limit.is_some_and(|n| n >= 10 && step % (n / 10) == 0) || (step_limit.is_none() && step % 100 == 0) {
            info!(worker, step, epochs = feed.epochs_done(), loss = losses[losses.len() - 1], "progress");
        }
        if let Some(held) = held.as_deref().filter(|_| step % args.eval_every == 0) {
            let point = evaluate_ctr_at(&client, &shape, held, step, feed.epochs_done()).await?;
            curve.push(point);
            if stops_early(&mut early, point, (worker, step, args.patience)) {
                stopped_early = true;
                break;
            }
        }
    }
    heartbeats.stop().await;
    step_log.finish()?;
    client.leave().await.context("leaving the cluster")?;
    for e in &feed.first_errors() {
        tracing::warn!(%e, "skipped a bad line");
    }
    let summary = WorkerSummary {
        heldout_curve: curve,
        stopped_early,
        ..WorkerSummary::new(&client, worker, &losses, started, samples_seen)
    };
    Ok(with_data(summary, &feed))
}

/// `summary` with what `feed` read: bad lines, passes over the data, dealt splits.
fn with_data(summary: WorkerSummary, feed: &crate::feed::Feed) -> WorkerSummary {
    let dealt = feed.dealt_state();
    WorkerSummary {
        bad_lines: feed.bad_lines(),
        epochs: feed.epochs_done(),
        data_sharding: if dealt.is_some() { DataSharding::Dynamic } else { DataSharding::Static },
        splits: dealt.map_or(0, |d| d.splits),
        ..summary
    }
}

/// The data a CTR worker reads (synthetic data from `--data-seed`) and its fixed share: with synthetic
/// data each worker its own stream (part `worker` of 1), with a file `--data-shard`.
fn ctr_data(args: &WorkerArgs, worker: u32) -> (crate::criteo::DataSpec, (u64, u64)) {
    let data = match &args.data {
        crate::criteo::DataSpec::Synthetic { .. } => crate::criteo::DataSpec::Synthetic { seed: args.data_seed },
        file => file.clone(),
    };
    let share = match data {
        crate::criteo::DataSpec::Synthetic { .. } => (u64::from(worker), 1),
        _ => args.data_shard,
    };
    (data, share)
}

/// A batch with its rows indexed ([`crate::recsys::index_batch`]).
fn indexed(batch: crate::feed::Batch) -> (crate::feed::Batch, crate::recsys::IndexedBatch) {
    let indexed = crate::recsys::index_batch(&batch.samples);
    (batch, indexed)
}

/// A feed of the splits the coordinator deals.
fn dealt_feed(
    args: &WorkerArgs,
    data: &crate::criteo::DataSpec,
    epochs: Option<u64>,
    worker: u32,
) -> crate::feed::Feed {
    // Passes over a file are the coordinator's to count (`gaps-server --data-epochs`).
    if epochs.is_some() && args.epochs.is_some() {
        info!(worker, "--epochs is the coordinator's with dynamic data sharding (gaps-server --data-epochs)");
    }
    crate::feed::Feed::dealt(data)
}

/// The first batch: dealt by the coordinator, or — when it deals no data (started without --data) — read
/// from this worker's fixed share, which then replaces `feed`.
async fn first_batch(
    feed: &mut crate::feed::Feed,
    client: &crate::Client,
    n: usize,
    fixed: impl Fn() -> Result<crate::feed::Feed>,
    (worker, part, parts): (u32, u64, u64),
) -> Result<crate::feed::Batch> {
    match feed.next_dealt(client, n).await {
        Ok(batch) => Ok(batch),
        Err(e) if no_dealer(&e) => {
            tracing::warn!(
                worker,
                "the coordinator deals no data (it was started without --data): this worker reads its fixed \
                 share, --data-shard {part}/{parts}"
            );
            *feed = fixed()?;
            feed.next_dealt(client, n).await
        }
        Err(e) => Err(e),
    }
}

/// A step's dense values and rows: those the last step was answered with (`pulled`), or pulled now.
async fn step_inputs(
    client: &crate::Client,
    pulled: Option<(crate::Snapshot, Option<crate::client::SparseRows>)>,
    ids: &[u64],
) -> Result<(crate::Snapshot, crate::client::SparseRows)> {
    let (dense, rows) = match pulled {
        Some((dense, Some(rows))) if rows.ids == ids => (Ok(dense), Ok(rows)),
        Some((dense, _)) => (Ok(dense), client.pull_sparse(0, ids, true).await),
        None => tokio::join!(client.pull(), client.pull_sparse(0, ids, true)),
    };
    Ok((dense.context("pulling dense parameters")?, rows.context("pulling embedding rows")?))
}

/// A CTR step's pushes, as one request per shard ([`crate::Client::step`]: the rows' gradients, the dense
/// gradients computed on `dense` answered with the next dense values, and the next batch's rows). The next
/// batch is the one read `ahead` during the step before, or read now; while this step is on the wire, the
/// batch after it is read into `ahead` where the data and the step limit go on that far (`further`). The
/// `last` step pushes both kinds of gradients alone. Returns the next dense values and rows, and the next
/// batch (None at the end of the local data or of a dealt split).
async fn push_ctr_step(
    client: &crate::Client,
    (dense_grads, dense): (Vec<Vec<f32>>, &crate::Snapshot),
    (rows, row_grads): (&crate::client::SparseRows, &[f32]),
    (feed, ahead): (&mut crate::feed::Feed, &mut Option<Result<Option<Prepared>>>),
    (n, last, further): (usize, bool, bool),
    step: u64,
) -> Result<Pushed> {
    if last {
        let (b, a) = tokio::join!(client.push_sparse(0, rows, row_grads), client.push(dense_grads, dense));
        a.with_context(|| format!("pushing dense gradients of step {step}"))?;
        b.with_context(|| format!("pushing embedding gradients of step {step}"))?;
        return Ok((None, Ok(None)));
    }
    let prepared = ahead.take().unwrap_or_else(|| feed.next_local(n).map(|b| b.map(indexed)));
    let further = further && matches!(prepared, Ok(Some(_)));
    let upcoming = prepared.as_ref().ok().and_then(Option::as_ref).map(|(_, indexed)| indexed.ids.as_slice());
    // `join!` polls in order: the step's requests are written before the batch after is read here, and the
    // read yields once first, so that on a current-thread runtime (one lane) the connections' tasks send
    // them before the read holds the thread.
    let read = async {
        tokio::task::yield_now().await;
        further.then(|| feed.next_local(n).map(|batch| batch.map(indexed)))
    };
    let (outcome, read) = tokio::join!(client.step(dense_grads, dense, (0, rows, row_grads), upcoming), read);
    *ahead = read;
    let outcome = outcome.with_context(|| format!("pushing the gradients of step {step}"))?;
    Ok((Some((outcome.dense, outcome.rows)), prepared))
}

/// A batch with its rows indexed.
type Prepared = (crate::feed::Batch, crate::recsys::IndexedBatch);

/// What a step's pushes bring: the next dense values and rows, and the next batch.
type Pushed = (Option<(crate::Snapshot, Option<crate::client::SparseRows>)>, Result<Option<Prepared>>);

/// Whether training stops at held-out `point` (the loss stopped improving), said in the log with the point.
fn stops_early(early: &mut EarlyStop, point: HeldOutPoint, (worker, step, patience): (u32, u64, u32)) -> bool {
    info!(worker, step, logloss = point.logloss, auc = point.auc, "held-out evaluation");
    let stop = early.record(point.logloss);
    if stop {
        info!(worker, step, best = early.best(), patience, "held-out loss stopped improving");
    }
    stop
}

/// The held-out point at `step` (`epochs` passes over the data done).
async fn evaluate_ctr_at(
    client: &crate::Client,
    shape: &gaps_models::recsys::CtrShape,
    held: &[gaps_models::criteo::Sample],
    step: u64,
    epochs: f64,
) -> Result<HeldOutPoint> {
    let (logloss, auc) = evaluate_ctr(client, shape, held)
        .await
        .with_context(|| format!("evaluating on held-out samples at step {step}"))?;
    Ok(HeldOutPoint { step, epochs: (epochs * 1000.0).round() / 1000.0, logloss, auc })
}

/// Whether `e` is the coordinator's refusal of a split request because it deals no data.
fn no_dealer(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        matches!(
            c.downcast_ref::<crate::ClientError>(),
            Some(crate::ClientError::Rpc(gaps_transport::net::RpcError::Remote { message, .. }))
                if message.contains("deals no data")
        )
    })
}

/// Log-loss and AUC of the cluster's current model on `samples` (rows are read without being created).
pub async fn evaluate_ctr(
    client: &crate::Client,
    shape: &gaps_models::recsys::CtrShape,
    samples: &[gaps_models::criteo::Sample],
) -> Result<(f64, f64), crate::ClientError> {
    let snapshot = client.pull().await?;
    let mut scores = Vec::with_capacity(samples.len());
    let mut loss = 0.0f64;
    let mut logits = Vec::new();
    for part in samples.chunks(4096) {
        let batch = gaps_models::recsys::index_batch(part);
        let rows = client.pull_sparse(0, &batch.ids, false).await?;
        loss += f64::from(gaps_models::recsys::forward(
            shape,
            &snapshot.tensors,
            &rows.values,
            &batch,
            part,
            &mut logits,
            None,
        ));
        scores.extend(logits.iter().map(|z| gaps_models::recsys::sigmoid(*z)));
    }
    let labels: Vec<u8> = samples.iter().map(|s| s.label).collect();
    Ok((loss / samples.len().max(1) as f64, gaps_models::criteo::auc(&scores, &labels)))
}
