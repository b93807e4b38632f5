//! The simulated world both event loops share: virtual workers and their due times, the in-process calls
//! to the shard core (pull, sparse rows, push), batches, durations, evaluation, set-up and the report.

use super::*;

/// A worker's next finishing time; the heap pops the earliest, ties broken by worker id.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Due {
    pub(super) time: f64,
    pub(super) worker: u32,
}

impl Eq for Due {}

impl Ord for Due {
    fn cmp(&self, other: &Self) -> Ordering {
        // Reversed, so that BinaryHeap (a max-heap) pops the earliest.
        other.time.total_cmp(&self.time).then_with(|| other.worker.cmp(&self.worker))
    }
}

impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// What a virtual worker holds: the values it last received, their version, and (DANA-Slim) its momentum.
pub(super) struct VirtualWorker {
    pub(super) view: Vec<f32>,
    pub(super) version: u64,
    pub(super) momentum: Vec<f32>,
    pub(super) seq: u64,
    /// Multiplies the mean time per batch.
    pub(super) slowness: f64,
    /// The duration of the batch it is computing now.
    pub(super) duration: f64,
    /// False once killed.
    pub(super) alive: bool,
    /// Steps pushed.
    pub(super) steps: u64,
    /// Embedding tasks: the batch this worker computes now, its rows and their versions when pulled.
    pub(super) batch: Vec<u32>,
    pub(super) rows: Vec<u64>,
    pub(super) row_versions: Vec<u32>,
}

impl VirtualWorker {
    /// Takes the parameters for the next batch: the dense part, and for an embedding task the next batch and
    /// its rows.
    pub(super) fn refresh(
        &mut self,
        core: &mut ShardCore,
        task: &dyn Task,
        batches: &mut Option<Batches>,
        wire: WireDtype,
    ) -> Result<()> {
        if let Some(b) = batches.as_mut() {
            self.batch = b.next();
            self.rows = task.batch_rows(&self.batch);
        }
        let (view, version, versions) = pull_view(core, task, wire, &self.rows)?;
        self.view = view;
        self.version = version;
        self.row_versions = versions;
        Ok(())
    }
}

pub(super) const CHUNK: ChunkId = ChunkId { tensor: 0, chunk: 0 };

pub(super) fn pull(core: &mut ShardCore, wire: WireDtype) -> Result<(Vec<f32>, u64)> {
    let (reply, _) = core.handle(Frame::new(Message::Pull(Pull { epoch: 1, chunks: vec![CHUNK] })), Duration::ZERO);
    match reply.msg {
        Message::PullReply(r) => {
            let version = r.chunks.first().map_or(0, |c: &ChunkVersion| c.version);
            let mut values = reply.payload;
            gaps_common::dtype::round_trip(wire, &mut values);
            Ok((values, version))
        }
        other => Err(anyhow!("the shard refused a pull: {other:?}")),
    }
}

/// An embedding task's worker view: the dense part pulled, and the rows of `ids` pulled (created) from
/// table 0 into their places; the other rows stay 0 (never read: the batch touches only `ids`). Returns
/// (values of every parameter, dense version, the rows' versions).
pub(super) fn pull_view(
    core: &mut ShardCore,
    task: &dyn Task,
    wire: WireDtype,
    ids: &[u64],
) -> Result<(Vec<f32>, u64, Vec<u32>)> {
    let rows = task.sparse_rows();
    let (dense, version) = pull(core, wire)?;
    if rows == 0 {
        return Ok((dense, version, Vec::new()));
    }
    let mut view = vec![0.0f32; task.num_params()];
    view[rows..].copy_from_slice(&dense);
    let versions = pull_rows_into(core, wire, ids, &mut view)?;
    Ok((view, version, versions))
}

/// Pulls (creating) the rows of `ids` into their places in `view`; returns their versions.
pub(super) fn pull_rows_into(core: &mut ShardCore, wire: WireDtype, ids: &[u64], view: &mut [f32]) -> Result<Vec<u32>> {
    let (values, versions) = sparse_pull(core, ids, true, wire)?;
    for (id, v) in ids.iter().zip(values) {
        view[*id as usize] = v;
    }
    Ok(versions)
}

/// Pulls rows of dim 1 of table 0: (values, versions).
pub(super) fn sparse_pull(
    core: &mut ShardCore,
    ids: &[u64],
    create: bool,
    wire: WireDtype,
) -> Result<(Vec<f32>, Vec<u32>)> {
    let mut words = Vec::with_capacity(2 * ids.len());
    gaps_common::wire::ids_to_words(ids, &mut words);
    let req = gaps_common::wire::SparsePull { epoch: 1, table: 0, count: ids.len() as u32, create };
    let (reply, _) = core.handle(Frame { msg: Message::SparsePull(req), payload: words }, Duration::ZERO);
    match reply.msg {
        Message::SparsePullReply(r) if r.dim == 1 && reply.payload.len() == 2 * ids.len() => {
            let versions = reply.payload[..ids.len()].iter().map(|w| w.to_bits()).collect();
            let mut values = reply.payload[ids.len()..].to_vec();
            gaps_common::dtype::round_trip(wire, &mut values);
            Ok((values, versions))
        }
        other => Err(anyhow!("the shard refused a sparse pull: {other:?}")),
    }
}

/// Every parameter at the shard: the rows of an embedding task read without creating them, then the dense
/// part.
pub(super) fn master_params(core: &mut ShardCore, task: &dyn Task) -> Result<Vec<f32>> {
    let rows = task.sparse_rows();
    let dense = core.chunk_values(CHUNK).map_err(|e| anyhow!("{e}"))?.to_vec();
    if rows == 0 {
        return Ok(dense);
    }
    let ids: Vec<u64> = (0..rows as u64).collect();
    let (mut all, _) = sparse_pull(core, &ids, false, WireDtype::F32)?;
    all.extend_from_slice(&dense);
    Ok(all)
}

/// The rows' part of one step of an embedding task: a sparse push of the gradients of `ids` (the batch's
/// rows, read at `versions`) before the dense push. Returns false when the shard found a non-finite value.
#[allow(clippy::too_many_arguments)]
pub(super) fn push_rows(
    core: &mut ShardCore,
    worker: u32,
    seq: u64,
    ids: &[u64],
    versions: &[u32],
    grad: &[f32],
    view: &[f32],
    echo: bool,
    wire: WireDtype,
) -> Result<bool> {
    let mut payload = Vec::with_capacity(3 * ids.len() + 2 * ids.len());
    gaps_common::wire::ids_to_words(ids, &mut payload);
    payload.extend(versions.iter().map(|v| f32::from_bits(*v)));
    let mut grads: Vec<f32> = ids.iter().map(|id| grad[*id as usize]).collect();
    gaps_common::dtype::round_trip(wire, &mut grads);
    payload.extend_from_slice(&grads);
    if echo {
        payload.extend(ids.iter().map(|id| view[*id as usize]));
    }
    let req = gaps_common::wire::SparsePush {
        epoch: 1,
        worker,
        seq,
        table: 0,
        count: ids.len() as u32,
        dim: 1,
        echo_read: echo,
    };
    let (reply, _) = core.handle(Frame { msg: Message::SparsePush(req), payload }, Duration::ZERO);
    match reply.msg {
        Message::Ack(_) => Ok(true),
        Message::Error(e) if e.code == gaps_common::ErrorCode::NonFinite => Ok(false),
        other => Err(anyhow!("the shard refused a sparse push: {other:?}")),
    }
}

/// The batches of an embedding task, taken when a worker starts one (it pulls exactly the batch's rows):
/// consecutive slices of a seeded permutation, reshuffled at the end of each pass.
pub(super) struct Batches {
    pub(super) order: Vec<u32>,
    pub(super) used: usize,
    pub(super) batch: usize,
    pub(super) rng: Rng,
}

impl Batches {
    pub(super) fn new(seed: u64, train: usize, batch: usize) -> Self {
        let mut rng = Rng::new(mix(seed, 0x5ba7));
        Batches { order: rng.permutation(train), used: 0, batch, rng }
    }

    pub(super) fn next(&mut self) -> Vec<u32> {
        if self.used + self.batch > self.order.len() {
            self.order = self.rng.permutation(self.order.len());
            self.used = 0;
        }
        self.used += self.batch;
        self.order[self.used - self.batch..self.used].to_vec()
    }
}

/// How long each batch takes: the Gamma model, or draws from a replayed profile.
pub(super) struct Durations {
    pub(super) shape: f64,
    /// Gamma scale before the worker's slowness: batch / shape.
    pub(super) scale: f64,
    pub(super) profile: Option<profile::Profile>,
}

impl Durations {
    pub(super) fn new(args: &SimArgs) -> Result<Self> {
        let profile = args.profile.as_deref().map(profile::Profile::load).transpose()?;
        Ok(Durations { shape: args.shape, scale: f64::from(args.batch) / args.shape, profile })
    }

    /// The next batch time of the worker in `slot` whose speed is divided by `slowness`.
    pub(super) fn draw(&self, rng: &mut Rng, slot: usize, slowness: f64) -> f64 {
        match &self.profile {
            Some(p) => p.draw(slot, rng) * slowness,
            None => rng.gamma(self.shape, self.scale * slowness),
        }
    }

    /// Milliseconds of a simulated duration as a worker reports it: a replayed profile is in seconds, the
    /// Gamma model's units count as milliseconds.
    pub(super) fn millis(&self, t: f64) -> f64 {
        if self.profile.is_some() {
            t * 1000.0
        } else {
            t
        }
    }

    /// The shard's clock at simulated time `t` (units as milliseconds, a profile's seconds as seconds).
    pub(super) fn clock(&self, t: f64) -> Duration {
        Duration::from_secs_f64((self.millis(t) / 1000.0).clamp(0.0, 1e12))
    }

    /// The simulated time at the shard's clock `d` (the inverse of [`Self::clock`]).
    pub(super) fn time_at_clock(&self, d: Duration) -> f64 {
        if self.profile.is_some() {
            d.as_secs_f64()
        } else {
            d.as_secs_f64() * 1000.0
        }
    }

    pub(super) fn unit(&self) -> &'static str {
        if self.profile.is_some() {
            "seconds"
        } else {
            "units"
        }
    }
}

/// Evaluates the test metric every `every` gradients (--evals-per-epoch).
pub(super) struct Evaluator {
    pub(super) every: u64,
    pub(super) next: u64,
    pub(super) batches_per_epoch: u64,
    pub(super) curve: Vec<CurvePoint>,
}

impl Evaluator {
    pub(super) fn new(args: &SimArgs, batches_per_epoch: usize) -> Self {
        let every = match args.evals() {
            0 => 0,
            k => (batches_per_epoch as u64 / u64::from(k)).max(1),
        };
        Evaluator { every, next: every, batches_per_epoch: batches_per_epoch.max(1) as u64, curve: Vec::new() }
    }

    /// Called after `gradients` gradients in all, at simulated time `now`.
    pub(super) fn after(&mut self, gradients: u64, now: f64, task: &dyn Task, core: &mut ShardCore) -> Result<()> {
        if self.every == 0 || gradients < self.next {
            return Ok(());
        }
        let params = master_params(core, task)?;
        let metric = if params.iter().all(|v| v.is_finite()) { task.test_metric(&params) } else { f64::NAN };
        self.curve.push(CurvePoint { epoch: gradients as f64 / self.batches_per_epoch as f64, time: now, metric });
        while self.next <= gradients {
            self.next += self.every;
        }
        Ok(())
    }
}

/// The shard and the task of a run, initialised.
pub(super) fn setup(args: &SimArgs) -> Result<(Box<dyn Task>, ShardCore, Hyper)> {
    let task = args.task();
    let p = task.num_params();
    let hyper = args.hyper.hyper(args.lr)?;
    let rows = task.sparse_rows();
    let dense = (p - rows) as u64;
    let tables = if rows > 0 {
        let l = args.rule.layout();
        if l.worker_planes > 0 || l.lookahead || l.worker_momentum {
            bail!(
                "--model {} keeps its embeddings in a sparse table, whose rule keeps no per-worker state and no \
                 look-ahead; {} does (use sgd, momentum, nesterov, staleness-aware, dc-asgd, gap-aware, adagrad or adam)",
                task.name(),
                args.rule
            );
        }
        vec![gaps_common::layout::SparseSpec::new(format!("{}.rows", task.name()), 1)]
    } else {
        Vec::new()
    };
    let layout = Layout::with_tables(vec![TensorSpec::new(task.name(), dense)], dense as u32, tables)?;
    let mut core = ShardCore::new(ShardConfig {
        shard: 0,
        num_shards: 1,
        layout,
        rule: args.rule,
        hyper,
        init: Init { seed: args.seed, std: 0.0 },
        lease: Duration::from_secs(1 << 30),
        advertise: "simulator".into(),
        epoch: 1,
        threads: 1,
        // Embedding rows: the same rule and hyper-parameters as the dense part, initialised as the task's
        // init does (0) and with Adagrad's accumulator starting at 0 (the dense rule's).
        sparse: gaps_shard::core::SparseSettings {
            rule: args.rule,
            hyper,
            init_std: 0.0,
            adagrad_init: 0.0,
            ..gaps_shard::core::SparseSettings::default()
        },
        modes: gaps_shard::modes::ModeConfig {
            mode: match args.mode {
                SimMode::Async => gaps_shard::modes::Mode::Async,
                SimMode::Sync => gaps_shard::modes::Mode::Sync,
                SimMode::Gba => gaps_shard::modes::Mode::Gba,
                SimMode::Ssp => gaps_shard::modes::Mode::Ssp,
                SimMode::Auto => gaps_shard::modes::Mode::Auto,
            },
            gba_threshold: args.gba_threshold,
            gba_hold: args.gba_hold,
            ssp_bound: args.ssp_bound,
            lr_ramp_steps: u64::try_from(args.lr_ramp_steps).ok(),
            ..gaps_shard::modes::ModeConfig::default()
        },
    })
    .map_err(|e| anyhow!("configuring the shard: {e}"))?;
    core.overwrite(CHUNK, &task.init(args.seed)[rows..]).map_err(|e| anyhow!("initialising: {e}"))?;
    Ok((task, core, hyper))
}

pub(super) fn open_csv(args: &SimArgs) -> Result<Option<std::io::BufWriter<std::fs::File>>> {
    match &args.csv {
        Some(path) => {
            let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
            let mut w = std::io::BufWriter::new(file);
            writeln!(w, "event,epoch,sim_time,worker,staleness,loss,lr,gap")?;
            Ok(Some(w))
        }
        None => Ok(None),
    }
}

/// The training length and the learning-rate schedule's turning points, in gradients.
pub(super) struct Schedule {
    pub(super) batches_per_epoch: usize,
    /// Gradients in the whole run.
    pub(super) total: u64,
    /// Gradients of warm-up.
    pub(super) warmup: u64,
    /// Gradients after which η is multiplied by 0.1.
    pub(super) decays: Vec<u64>,
}

impl Schedule {
    pub(super) fn new(args: &SimArgs, task: &dyn Task) -> Self {
        let batches_per_epoch = task.train_size() / args.batch as usize;
        let total = batches_per_epoch as u64 * u64::from(args.epochs);
        let warmup = (args.warmup_epochs * batches_per_epoch as f64) as u64;
        let decays = if args.no_lr_decay {
            Vec::new()
        } else {
            args.lr_decay_at.iter().map(|f| (f * total as f64) as u64).collect()
        };
        Schedule { batches_per_epoch, total, warmup, decays }
    }
}

/// Learning-rate multiplier of the schedule: warm-up from `start` to 1 over `warmup` steps, ×0.1 at each decay.
pub(super) fn schedule(step: u64, warmup: u64, start: f64, decays: &[u64]) -> f64 {
    let warm = if step < warmup { start + (1.0 - start) * step as f64 / warmup as f64 } else { 1.0 };
    warm * 0.1f64.powi(decays.iter().filter(|d| step >= **d).count() as i32)
}

/// A worker that must wait (sync step, SSP bound) before starting its next batch.
pub(super) struct Blocked {
    pub(super) worker: usize,
    /// The shard's global step to wait for (synchronous modes).
    pub(super) step: u64,
    pub(super) clock: u64,
    /// The duration of its next batch, drawn when it was popped (so the draw order never depends on waits).
    pub(super) duration: f64,
    /// GBA's hold: goes on at this simulated time if the step has not come by then.
    pub(super) until: Option<f64>,
}

/// Registers one virtual worker with the shard and returns its id.
pub(super) fn register(core: &mut ShardCore) -> Result<u32> {
    let reg = gaps_common::wire::Register {
        protocol: gaps_common::wire::PROTOCOL_VERSION,
        role: gaps_common::wire::Role::Worker,
        name: "sim".into(),
    };
    match core.handle(Frame::new(Message::Register(reg)), Duration::ZERO).0.msg {
        Message::ClusterMap(map) => map.worker_id.ok_or_else(|| anyhow!("the shard gave no worker id")),
        other => Err(anyhow!("the shard refused a registration: {other:?}")),
    }
}

/// Counters of a finished event loop.
pub(super) struct Outcome {
    pub(super) staleness: Vec<u32>,
    pub(super) gap_sum: f64,
    pub(super) now: f64,
    pub(super) diverged: bool,
    pub(super) events: u64,
    pub(super) started: Instant,
    /// Gradients computed.
    pub(super) gradients: u64,
    pub(super) evaluator: Evaluator,
    pub(super) durations: Durations,
    /// Training loss at the initial parameters.
    pub(super) initial_loss: f64,
}

pub(super) fn finish(args: &SimArgs, task: &dyn Task, core: &mut ShardCore, o: Outcome) -> Result<SimReport> {
    let Outcome {
        staleness,
        gap_sum,
        now,
        mut diverged,
        events,
        started,
        gradients,
        evaluator,
        durations,
        initial_loss,
    } = o;
    let real = started.elapsed().as_secs_f64();
    let params = master_params(core, task)?;
    diverged |= params.iter().any(|v| !v.is_finite());
    let (metric, train_loss) = if diverged { (f64::NAN, f64::NAN) } else { task.evaluate(&params) };
    // Training that ends with a higher (or NaN) loss than it started from has diverged, whatever its
    // numbers stayed finite (a momentum run ending at a loss of 17 against chance's 2.3 did).
    diverged |= train_loss.is_nan() || train_loss > initial_loss;
    let mut curve = evaluator.curve;
    if evaluator.every > 0 && curve.last().is_none_or(|c| c.time < now) {
        curve.push(CurvePoint { epoch: gradients as f64 / evaluator.batches_per_epoch as f64, time: now, metric });
    }
    let time_to_target = args.target.and_then(|t| {
        // Without intermediate evaluations only the end can reach the target.
        let end = [CurvePoint { epoch: 0.0, time: now, metric }];
        time_to_reach(if curve.is_empty() { &end } else { &curve }, t, task.higher_is_better())
    });
    let mut sorted = staleness.clone();
    sorted.sort_unstable();
    let p99 =
        sorted.get(((sorted.len() as f64 * 0.99) as usize).min(sorted.len().saturating_sub(1))).copied().unwrap_or(0);
    Ok(SimReport {
        rule: args.rule.name().into(),
        model: task.name().into(),
        workers: args.workers,
        shape: args.shape,
        seed: args.seed,
        final_test_metric: metric,
        final_train_loss: train_loss,
        initial_train_loss: initial_loss,
        diverged,
        staleness_mean: staleness.iter().map(|t| f64::from(*t)).sum::<f64>() / staleness.len().max(1) as f64,
        staleness_p99: u64::from(p99),
        gap_mean: gap_sum / events.max(1) as f64,
        sim_wall_time: now,
        events,
        events_per_s: events as f64 / real.max(1e-9),
        lookahead: if args.rule.layout().lookahead { Some(pull(core, args.pull_dtype)?.0) } else { None },
        mode_switches: core.stats().mode_switches,
        steps_sync: core.stats().steps_sync,
        steps_gba: core.stats().steps_gba,
        dropped_stale: core.stats().dropped_stale,
        workers_final: args.workers,
        lr_multiplier_final: f64::from(core.stats().lr_multiplier_milli) / 1000.0,
        params,
        curve,
        time_to_target,
        time_unit: durations.unit(),
    })
}
