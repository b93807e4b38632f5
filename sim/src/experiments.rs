//! `gaps sim experiments`: the small-scale reproductions of docs/ALGORITHMS.md §7 — E1 (momentum × staleness
//! on the MLP, with the §12 pass criteria checked), E2 (exact equivalences), E3 (stability boundaries), E5
//! (elastic resize, immediate vs ramped learning rate), E4 (GBA against sync and async with stragglers), E6
//! (8 to 256 workers: the rules that survive large N, the published NAdam update and Gap-Adam) —
//! written as a markdown report and an SVG plot under
//! `docs/results/`.

use super::{run, ModelChoice, SimArgs, SimReport};
use anyhow::{Context, Result};
use gaps_flags::HyperArgs;
use gaps_kernels::{Bufs, Hyper, PushScalars, Rule};
use std::fmt::Write as _;
use std::path::Path;
use std::sync::Mutex;

/// One E1 method: a rule with the §11 settings.
#[derive(Debug, Clone, Copy)]
pub struct Method {
    /// Label in tables.
    pub label: &'static str,
    /// The rule.
    pub rule: Rule,
    /// Momentum γ.
    pub momentum: f32,
    /// Multiplier of the base η (ASGD and GA without momentum use η/(1−γ) = 10η, the same effective step).
    pub lr_factor: f32,
    /// Synchronous global-batch training instead of asynchronous pushes.
    pub sync: bool,
}

/// The E1 methods.
pub const METHODS: [Method; 14] = [
    Method { label: "ASGD (η/(1−γ))", rule: Rule::Sgd, momentum: 0.0, lr_factor: 10.0, sync: false },
    Method {
        label: "GA, no momentum (η/(1−γ))", rule: Rule::GapAware, momentum: 0.0, lr_factor: 10.0, sync: false
    },
    Method { label: "ASGD+M", rule: Rule::Momentum, momentum: 0.9, lr_factor: 1.0, sync: false },
    Method { label: "NAG-ASGD", rule: Rule::Nesterov, momentum: 0.9, lr_factor: 1.0, sync: false },
    Method { label: "Delay-NAG (our reading)", rule: Rule::DelayNesterov, momentum: 0.9, lr_factor: 1.0, sync: false },
    Method { label: "SA (+M)", rule: Rule::StalenessAware, momentum: 0.9, lr_factor: 1.0, sync: false },
    Method { label: "GA (+M)", rule: Rule::GapAware, momentum: 0.9, lr_factor: 1.0, sync: false },
    Method { label: "DC-ASGD-a (+M)", rule: Rule::DcAsgdAdaptive, momentum: 0.9, lr_factor: 1.0, sync: false },
    Method { label: "Multi-ASGD", rule: Rule::MultiMomentum, momentum: 0.9, lr_factor: 1.0, sync: false },
    Method { label: "DANA-Zero", rule: Rule::DanaZero, momentum: 0.9, lr_factor: 1.0, sync: false },
    Method { label: "DANA-Slim", rule: Rule::DanaSlim, momentum: 0.9, lr_factor: 1.0, sync: false },
    Method { label: "DANA-DC", rule: Rule::DanaDc, momentum: 0.9, lr_factor: 1.0, sync: false },
    Method { label: "DANA-GA", rule: Rule::DanaGa, momentum: 0.9, lr_factor: 1.0, sync: false },
    Method { label: "SSGD (linear scaling)", rule: Rule::Momentum, momentum: 0.9, lr_factor: 1.0, sync: true },
];

/// The E6 methods ("256 workers"): the rules that still train past 64 workers in E1, the published
/// asynchronous-pipeline Nesterov update (NAdam with β1 0.99, its learning rate chosen on E1 at N = 256
/// among 3e-4, 5e-4, 7e-4 and 1e-3) beside our reading of it, and Gap-Adam (η 0.016, chosen among 0.01,
/// 0.012, 0.016 and 0.02 at N = 256). `lr_factor` multiplies the base η 0.05.
pub const E6_METHODS: [Method; 9] = [
    Method { label: "SSGD (linear scaling)", rule: Rule::Momentum, momentum: 0.9, lr_factor: 1.0, sync: true },
    Method { label: "ASGD+M", rule: Rule::Momentum, momentum: 0.9, lr_factor: 1.0, sync: false },
    Method { label: "SA (+M)", rule: Rule::StalenessAware, momentum: 0.9, lr_factor: 1.0, sync: false },
    Method { label: "DANA-Zero", rule: Rule::DanaZero, momentum: 0.9, lr_factor: 1.0, sync: false },
    Method { label: "Delay-NAG (our reading)", rule: Rule::DelayNesterov, momentum: 0.9, lr_factor: 1.0, sync: false },
    Method { label: "NAdam β1 0.99 (published)", rule: Rule::Nadam, momentum: 0.99, lr_factor: 0.01, sync: false },
    Method { label: "GA (+M)", rule: Rule::GapAware, momentum: 0.9, lr_factor: 1.0, sync: false },
    Method { label: "DANA-GA", rule: Rule::DanaGa, momentum: 0.9, lr_factor: 1.0, sync: false },
    Method { label: "Gap-Adam (new)", rule: Rule::GapAdam, momentum: 0.9, lr_factor: 0.32, sync: false },
];

/// E6's worker counts.
pub const E6_WORKERS: [u32; 6] = [8, 16, 32, 64, 128, 256];

/// Grid of an experiments run.
#[derive(Debug, Clone)]
pub struct Grid {
    /// Worker counts.
    pub workers: Vec<u32>,
    /// Base learning rates.
    pub lrs: Vec<f32>,
    /// Seeds.
    pub seeds: Vec<u64>,
    /// Epochs per run.
    pub epochs: u32,
}

impl Grid {
    /// The reduced grid of `--quick` (η = 0.05 only).
    pub fn quick() -> Self {
        Grid { workers: vec![8, 16, 32, 64], lrs: vec![0.05], seeds: vec![1, 2, 3], epochs: 20 }
    }

    /// The full grid: η ∈ {0.05, 0.1}, 3 seeds.
    pub fn full() -> Self {
        Grid { workers: vec![8, 16, 32, 64], lrs: vec![0.05, 0.1], seeds: vec![1, 2, 3], epochs: 20 }
    }
}

fn args_for(m: &Method, workers: u32, lr: f32, shape: f64, seed: u64, epochs: u32) -> SimArgs {
    SimArgs {
        model: ModelChoice::Mlp,
        rule: m.rule,
        workers,
        shape,
        seed,
        epochs,
        lr: lr * m.lr_factor,
        hyper: HyperArgs { momentum: m.momentum, ..HyperArgs::default() },
        mode: if m.sync { super::SimMode::Sync } else { super::SimMode::Async },
        ..SimArgs::defaults()
    }
}

/// Runs simulations on all cores; results come back in input order, so output does not depend on timing.
pub fn run_all(jobs: Vec<SimArgs>) -> Result<Vec<SimReport>> {
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(jobs.len().max(1));
    let next = Mutex::new(0usize);
    let results: Mutex<Vec<Option<Result<SimReport>>>> = Mutex::new((0..jobs.len()).map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let i = {
                    let Ok(mut n) = next.lock() else { return };
                    let i = *n;
                    *n += 1;
                    i
                };
                let Some(job) = jobs.get(i) else { return };
                let r = run(job);
                if let Ok(mut all) = results.lock() {
                    all[i] = Some(r);
                }
            });
        }
    });
    let all = results.into_inner().map_err(|_| anyhow::anyhow!("a simulation thread panicked"))?;
    all.into_iter().map(|r| r.unwrap_or_else(|| Err(anyhow::anyhow!("a simulation did not run")))).collect()
}

pub(crate) fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len().max(1) as f64
}

/// E1 results: accuracy (mean over seeds; NaN when every seed diverged) per method and worker count.
#[derive(Debug, Clone)]
pub struct E1 {
    /// Base learning rate.
    pub lr: f32,
    /// Gamma shape.
    pub shape: f64,
    /// Worker counts (columns).
    pub workers: Vec<u32>,
    /// Sequential baseline (N = 1, SGD + momentum): accuracy, loss.
    pub baseline: (f64, f64),
    /// The standard deviation of the baseline's accuracy over the seeds.
    pub baseline_sd: f64,
    /// Per method, one cell per worker count.
    pub rows: Vec<(Method, Vec<Cell>)>,
}

/// One E1 cell: a method at one worker count, over the seeds.
#[derive(Debug, Clone, Copy)]
pub struct Cell {
    /// Mean test accuracy % of the seeds that did not diverge (NaN when all diverged).
    pub accuracy: f64,
    /// Mean final training loss of those seeds.
    pub loss: f64,
    /// Standard deviation of those seeds' accuracies (0 with one seed; NaN when all diverged).
    pub sd: f64,
    /// Seeds that diverged.
    pub diverged: usize,
    /// Seeds run.
    pub total: usize,
}

impl E1 {
    /// Accuracy of a method label at N workers.
    pub fn accuracy(&self, label: &str, workers: u32) -> f64 {
        self.cell(label, workers).map_or(f64::NAN, |c| c.accuracy)
    }

    /// The cell of a method label at N workers.
    pub fn cell(&self, label: &str, workers: u32) -> Option<Cell> {
        let col = self.workers.iter().position(|w| *w == workers)?;
        self.rows.iter().find(|(m, _)| m.label == label).map(|(_, r)| r[col])
    }
}

/// Runs E1 at one learning rate and shape.
pub fn e1(grid: &Grid, lr: f32, shape: f64) -> Result<E1> {
    table_of(&METHODS, grid, lr, shape)
}

/// Runs E6: the E1 task from 8 to 256 workers with the methods that survive large N.
pub fn e6(grid: &Grid) -> Result<E1> {
    table_of(&E6_METHODS, &Grid { workers: E6_WORKERS.to_vec(), ..grid.clone() }, 0.05, 100.0)
}

/// Sample standard deviation (0 for fewer than two values).
pub(crate) fn sd(xs: &[f64]) -> f64 {
    if xs.len() < 2 {
        return 0.0;
    }
    let m = mean(xs);
    (xs.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (xs.len() - 1) as f64).sqrt()
}

/// Every method of `methods` at every worker count and seed of `grid`, beside the sequential baseline.
fn table_of(methods: &[Method], grid: &Grid, lr: f32, shape: f64) -> Result<E1> {
    let mut jobs = Vec::new();
    for seed in &grid.seeds {
        jobs.push(args_for(&METHODS[2], 1, lr, shape, *seed, grid.epochs));
    }
    for m in methods {
        for w in &grid.workers {
            for seed in &grid.seeds {
                jobs.push(args_for(m, *w, lr, shape, *seed, grid.epochs));
            }
        }
    }
    let reports = run_all(jobs)?;
    let s = grid.seeds.len();
    let base: Vec<&SimReport> = reports[..s].iter().collect();
    let base_acc: Vec<f64> = base.iter().map(|r| r.final_test_metric).collect();
    let baseline = (mean(&base_acc), mean(&base.iter().map(|r| r.final_train_loss).collect::<Vec<_>>()));
    let mut rows = Vec::new();
    let mut k = s;
    for m in methods.iter().copied() {
        let mut cells = Vec::new();
        for _ in &grid.workers {
            let runs = &reports[k..k + s];
            k += s;
            let ok: Vec<&SimReport> = runs.iter().filter(|r| !r.diverged).collect();
            let accs: Vec<f64> = ok.iter().map(|r| r.final_test_metric).collect();
            let (acc, spread) = if ok.is_empty() { (f64::NAN, f64::NAN) } else { (mean(&accs), sd(&accs)) };
            let loss =
                if ok.is_empty() { f64::NAN } else { mean(&ok.iter().map(|r| r.final_train_loss).collect::<Vec<_>>()) };
            cells.push(Cell { accuracy: acc, loss, sd: spread, diverged: runs.len() - ok.len(), total: runs.len() });
        }
        rows.push((m, cells));
    }
    Ok(E1 { lr, shape, workers: grid.workers.clone(), baseline, baseline_sd: sd(&base_acc), rows })
}

fn e1_table(e: &E1) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "Shape {}, η = {}; sequential baseline (N = 1, SGD + momentum): **{:.1} ± {:.1} % / {:.3}**\n",
        e.shape, e.lr, e.baseline.0, e.baseline_sd, e.baseline.1
    );
    let _ = write!(s, "| method |");
    for w in &e.workers {
        let _ = write!(s, " N={w} |");
    }
    let _ = write!(s, "\n|---|");
    for _ in &e.workers {
        let _ = write!(s, "---|");
    }
    s.push('\n');
    for (m, cells) in &e.rows {
        let _ = write!(s, "| {} |", m.label);
        for Cell { accuracy: acc, loss, sd, diverged, total } in cells {
            if *diverged == *total {
                let _ = write!(s, " diverged {diverged}/{total} |");
            } else if *diverged > 0 {
                let _ = write!(s, " {acc:.1} ± {sd:.1} / {loss:.3} (diverged {diverged}/{total}) |");
            } else {
                let _ = write!(s, " {acc:.1} ± {sd:.1} / {loss:.3} |");
            }
        }
        s.push('\n');
    }
    s
}

/// The §12 E1 pass criteria, each with its verdict.
pub fn e1_criteria(e: &E1, shape1: Option<&E1>) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    for w in e.workers.iter().filter(|w| **w >= 32) {
        let (ga, sa) = (e.accuracy("GA (+M)", *w), e.accuracy("SA (+M)", *w));
        out.push((format!("GA > SA at N = {w}: {ga:.1} vs {sa:.1}"), ga > sa));
    }
    for w in e.workers.iter().filter(|w| **w <= 16) {
        let (slim, zero) = (e.accuracy("DANA-Slim", *w), e.accuracy("DANA-Zero", *w));
        out.push((
            format!("DANA-Slim within 0.5 pt of DANA-Zero at N = {w}: {slim:.1} vs {zero:.1}"),
            (slim - zero).abs() <= 0.5,
        ));
    }
    if e.workers.contains(&32) {
        let (m, dga) = (e.accuracy("ASGD+M", 32), e.accuracy("DANA-GA", 32));
        let pass = m.is_nan() || dga - m >= 20.0;
        out.push((format!("ASGD+M at N = 32 at least 20 pt below DANA-GA: {m:.1} vs {dga:.1}"), pass));
    }
    if let Some(s1) = shape1 {
        for (m, cells) in &s1.rows {
            for (w, cell) in s1.workers.iter().zip(cells) {
                let within = (s1.baseline.0 - cell.accuracy).abs() <= 5.0;
                out.push((
                    format!(
                        "shape 1, {} at N = {w} within 5 pt of the baseline: {:.1} vs {:.1}",
                        m.label, cell.accuracy, s1.baseline.0
                    ),
                    within,
                ));
            }
        }
    }
    out
}

/// E6's verdicts: Gap-Adam's mean within 1 point of the sequential baseline at the largest N, and at N = 64
/// no worse than DANA-GA's mean minus its seed spread.
pub fn e6_criteria(e: &E1) -> Vec<(String, bool)> {
    let cell = |label: &str, w: u32| e.cell(label, w);
    let mut out = Vec::new();
    let top = e.workers.iter().copied().max().unwrap_or(0);
    if let Some(new) = cell("Gap-Adam (new)", top) {
        out.push((
            format!(
                "Gap-Adam within 1 pt of the sequential baseline at N = {top}: {:.2} ± {:.2} vs {:.2} ± {:.2}",
                new.accuracy, new.sd, e.baseline.0, e.baseline_sd
            ),
            e.baseline.0 - new.accuracy <= 1.0,
        ));
    }
    if let (Some(new), Some(dga)) = (cell("Gap-Adam (new)", 64), cell("DANA-GA", 64)) {
        out.push((
            format!(
                "Gap-Adam at N = 64 no worse than DANA-GA's mean minus its spread: {:.2} vs {:.2} − {:.2}",
                new.accuracy, dga.accuracy, dga.sd
            ),
            new.accuracy >= dga.accuracy - dga.sd,
        ));
    }
    out
}

/// E2: the exact equivalences, measured in the simulator.
pub fn e2(epochs: u32) -> Result<Vec<(String, String, bool)>> {
    let constant = |rule: Rule, workers: u32| SimArgs {
        rule,
        workers,
        epochs,
        warmup_epochs: 0.0,
        lr_decay_at: vec![],
        ..SimArgs::defaults()
    };
    let reports = run_all(vec![
        constant(Rule::DanaZero, 16),
        constant(Rule::DanaSlim, 16),
        SimArgs { rule: Rule::GapAware, workers: 1, epochs, ..SimArgs::defaults() },
        SimArgs { rule: Rule::Momentum, workers: 1, epochs, ..SimArgs::defaults() },
        SimArgs { rule: Rule::StalenessAware, workers: 1, epochs, ..SimArgs::defaults() },
    ])?;
    let mut out = Vec::new();
    // DANA-Zero's workers compute on θ − ηγS; DANA-Slim's master stores exactly that vector.
    let zero_view = lookahead(&reports[0]);
    let diff = zero_view.iter().zip(&reports[1].params).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    let scale = reports[1].params.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    out.push((
        format!("DANA-Slim Θ vs DANA-Zero look-ahead, N = 16, constant η, {epochs} epochs"),
        format!("max abs(Θ − θ̂) = {diff:.2e}, max abs(θ) = {scale:.2}"),
        diff <= 1e-4 * scale.max(1.0),
    ));
    let same = |a: &SimReport, b: &SimReport| a.params.iter().zip(&b.params).all(|(x, y)| x.to_bits() == y.to_bits());
    out.push((
        "GA at N = 1 vs SGD + momentum".into(),
        format!("bit-identical: {}", same(&reports[2], &reports[3])),
        same(&reports[2], &reports[3]),
    ));
    out.push((
        "SA at N = 1 vs SGD + momentum".into(),
        format!("bit-identical: {}", same(&reports[4], &reports[3])),
        same(&reports[4], &reports[3]),
    ));
    Ok(out)
}

/// The look-ahead a DANA-Zero run's workers would receive next (θ − ηγS), recomputed from the report.
fn lookahead(r: &SimReport) -> Vec<f32> {
    r.lookahead.clone().unwrap_or_else(|| r.params.clone())
}

/// Is the round-robin delayed system stable at step η (curvature 1) with `workers` workers?
fn stable(rule: Rule, gamma: f32, eta: f32, workers: usize, events: usize) -> bool {
    let h = Hyper { lr: eta, momentum: gamma, ..Hyper::default() };
    let l = rule.layout();
    let mut theta = [1.0f32];
    let mut shared = vec![0.0f32; l.shared_planes];
    let mut worker_state = vec![vec![0.0f32; l.worker_planes]; workers];
    let mut views = vec![1.0f32; workers];
    for t in 0..events {
        let w = t % workers;
        let g = [views[w]];
        let s = PushScalars::fresh(eta, t as u64 + 1);
        let bufs = Bufs::from_planes(&mut theta, &mut shared, &mut worker_state[w], &g, &[]);
        if gaps_kernels::apply(rule, &h, &s, bufs).is_err() {
            return false;
        }
        let mut v = Vec::with_capacity(1);
        gaps_kernels::pull_values(rule, &h, eta, workers as u32, &theta, &shared, &mut v);
        views[w] = v[0];
        if !theta[0].is_finite() || theta[0].abs() > 1e6 {
            return false;
        }
    }
    theta[0].abs() < 1.0
}

/// Largest stable η·h by bisection (log scale).
fn critical(rule: Rule, gamma: f32, workers: usize) -> f32 {
    let (mut lo, mut hi) = (1e-5f32, 2.0f32);
    for _ in 0..40 {
        let mid = (lo * hi).sqrt();
        if stable(rule, gamma, mid, workers, 60_000) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// E3: predicted and measured critical η·h for delay τ = N − 1 (round robin).
pub fn e3() -> Vec<(usize, f32, f32, f32, f32, f32)> {
    let taus = [7usize, 15, 31];
    let predicted_hb = [0.0159f32, 0.0079, 0.0042];
    taus.iter()
        .zip(predicted_hb)
        .map(|(tau, hb)| {
            let n = tau + 1;
            let gd_pred = 2.0 * (std::f32::consts::PI / (2.0 * (2.0 * *tau as f32 + 1.0))).sin();
            (
                *tau,
                gd_pred,
                critical(Rule::Sgd, 0.0, n),
                hb,
                critical(Rule::Momentum, 0.9, n),
                critical(Rule::DanaZero, 0.9, n),
            )
        })
        .collect()
}

/// E5: elastic SSGD, N alternating 8 ↔ 64 every 2 epochs, immediate linear scaling against the
/// Dynamic-SGD ramp (T = 8k rounds on growth). Returns (η, immediate, ramp) accuracies (mean over seeds).
pub fn e5(lrs: &[f32], seeds: &[u64]) -> Result<Vec<(f32, f64, f64)>> {
    let mut jobs = Vec::new();
    for lr in lrs {
        for ramp in [0i64, -1] {
            for seed in seeds {
                jobs.push(SimArgs {
                    mode: super::SimMode::Sync,
                    workers: 8,
                    elastic: vec![8, 64],
                    elastic_every: 2,
                    lr_ramp_steps: ramp,
                    lr: *lr,
                    seed: *seed,
                    ..SimArgs::defaults()
                });
            }
        }
    }
    let reports = run_all(jobs)?;
    let s = seeds.len();
    Ok(lrs
        .iter()
        .enumerate()
        .map(|(i, lr)| {
            let acc =
                |k: usize| mean(&reports[k * s..(k + 1) * s].iter().map(|r| r.final_test_metric).collect::<Vec<_>>());
            (*lr, acc(2 * i), acc(2 * i + 1))
        })
        .collect())
}

/// One E4 row: a mode at N workers with 25 % stragglers 3× slower, mean over seeds.
#[derive(Debug, Clone, Copy)]
pub struct E4Row {
    /// Workers.
    pub workers: u32,
    /// Mode.
    pub mode: super::SimMode,
    /// Test AUC.
    pub auc: f64,
    /// Simulated wall-clock time.
    pub wall: f64,
    /// Mean staleness.
    pub staleness: f64,
}

/// E4: the CTR model (hashed logistic regression, Adagrad η 0.05, batch 64, 3 epochs of 65,536 samples)
/// with the first quarter of the workers 3× slower: sync, GBA (K = N, threshold 4) and async, all with the
/// synchronous hyper-parameters.
pub fn e4(workers: &[u32], seeds: &[u64]) -> Result<Vec<E4Row>> {
    use super::SimMode;
    let modes = [SimMode::Sync, SimMode::Gba, SimMode::Async];
    let mut jobs = Vec::new();
    for n in workers {
        for mode in modes {
            for seed in seeds {
                jobs.push(SimArgs {
                    model: ModelChoice::Ctr,
                    rule: Rule::Adagrad,
                    mode,
                    workers: *n,
                    seed: *seed,
                    lr: 0.05,
                    hyper: HyperArgs { momentum: 0.0, ..HyperArgs::default() },
                    warmup_epochs: 0.0,
                    no_lr_decay: true,
                    linear_scaling: false,
                    epochs: 3,
                    batch: 64,
                    train: 65_536,
                    test: 20_000,
                    stragglers: (0..n / 4).map(|w| (w, 3.0)).collect(),
                    ..SimArgs::defaults()
                });
            }
        }
    }
    let reports = run_all(jobs)?;
    let s = seeds.len();
    let mut rows = Vec::new();
    let mut k = 0;
    for n in workers {
        for mode in modes {
            let r = &reports[k..k + s];
            k += s;
            let avg = |f: &dyn Fn(&SimReport) -> f64| mean(&r.iter().map(f).collect::<Vec<_>>());
            rows.push(E4Row {
                workers: *n,
                mode,
                auc: avg(&|r| r.final_test_metric),
                wall: avg(&|r| r.sim_wall_time),
                staleness: avg(&|r| r.staleness_mean),
            });
        }
    }
    Ok(rows)
}

/// The plots' line colours, in order.
pub(crate) const COLORS: [&str; 12] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
    "#000000", "#aa3377",
];

/// The opening of a `w`×`h` SVG chart: the element, a white background and `title` centred at `title_x`.
pub(crate) fn svg_open(w: f64, h: f64, title_x: f64, title: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(s, r#"<text x="{title_x}" y="18" text-anchor="middle" font-size="14">{title}</text>"#);
    s
}

/// One data series: its polyline through `points` and a dot at each.
pub(crate) fn svg_series(s: &mut String, color: &str, points: &[(f64, f64)]) {
    let line: Vec<String> = points.iter().map(|(a, b)| format!("{a:.1},{b:.1}")).collect();
    let _ = writeln!(s, r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#, line.join(" "));
    for (a, b) in points {
        let _ = writeln!(s, r#"<circle cx="{a:.1}" cy="{b:.1}" r="3" fill="{color}"/>"#);
    }
}

/// A legend entry: a short line in `color` at (x, y) and its label.
pub(crate) fn svg_legend(s: &mut String, x: f64, y: f64, color: &str, label: &str) {
    let _ = writeln!(
        s,
        r#"<line x1="{x}" y1="{y}" x2="{}" y2="{y}" stroke="{color}" stroke-width="2"/><text x="{}" y="{}">{label}</text>"#,
        x + 20.0,
        x + 26.0,
        y + 4.0
    );
}

/// A line chart of accuracy against worker count, one line per method (SVG text).
pub fn svg_plot(e: &E1) -> String {
    let (w, h, left, right, top, bottom) = (760.0, 440.0, 60.0, 230.0, 30.0, 50.0);
    let pw = w - left - right;
    let ph = h - top - bottom;
    let xs: Vec<f64> = e.workers.iter().map(|n| f64::from(*n).log2()).collect();
    let (xmin, xmax) = (xs.first().copied().unwrap_or(0.0), xs.last().copied().unwrap_or(1.0));
    let x = |v: f64| left + (v - xmin) / (xmax - xmin).max(1e-9) * pw;
    let y = |acc: f64| top + (1.0 - (acc.clamp(0.0, 100.0) - 0.0) / 100.0) * ph;
    let title = format!("Test accuracy vs workers (MLP, Gamma shape {}, η {})", e.shape, e.lr);
    let mut s = svg_open(w, h, left + pw / 2.0, &title);
    for acc in (0..=100).step_by(20) {
        let yy = y(f64::from(acc));
        let _ = writeln!(
            s,
            r##"<line x1="{left}" y1="{yy}" x2="{}" y2="{yy}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{acc}</text>"##,
            left + pw,
            left - 6.0,
            yy + 4.0
        );
    }
    for (n, xv) in e.workers.iter().zip(&xs) {
        let _ = writeln!(s, r#"<text x="{}" y="{}" text-anchor="middle">{n}</text>"#, x(*xv), top + ph + 18.0);
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">workers N (log scale)</text>"#,
        left + pw / 2.0,
        h - 10.0
    );
    let base = y(e.baseline.0);
    let _ = writeln!(
        s,
        r##"<line x1="{left}" y1="{base}" x2="{}" y2="{base}" stroke="#444" stroke-dasharray="4 4"/>"##,
        left + pw
    );
    let _ = writeln!(
        s,
        r##"<text x="{}" y="{}" fill="#444">sequential {:.1}</text>"##,
        left + 4.0,
        base - 4.0,
        e.baseline.0
    );
    for (i, (m, cells)) in e.rows.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let points: Vec<(f64, f64)> = xs
            .iter()
            .zip(cells)
            .filter(|(_, c)| c.accuracy.is_finite())
            .map(|(xv, c)| (x(*xv), y(c.accuracy)))
            .collect();
        svg_series(&mut s, color, &points);
        for (xv, c) in xs.iter().zip(cells) {
            if !c.accuracy.is_finite() {
                let _ = writeln!(
                    s,
                    r#"<text x="{:.1}" y="{:.1}" fill="{color}" text-anchor="middle">×</text>"#,
                    x(*xv),
                    top + ph - 4.0
                );
            }
        }
        svg_legend(&mut s, left + pw + 15.0, top + 10.0 + i as f64 * 18.0, color, m.label);
    }
    s.push_str("</svg>\n");
    s
}

/// Runs E1 (shape 100 at every η of the grid, and shape 1 at N = 32), E2, E3 and E5, writes
/// `experiments.md` and `e1.svg` into `out`, and returns the markdown.
pub fn run_experiments(grid: &Grid, out: &Path, command: &str) -> Result<String> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let started = std::time::Instant::now();
    let mut md = String::new();
    let _ = writeln!(md, "# Simulator experiments\n\nRegenerate with `{command}` (seeds {:?}, {} epochs, batch 32, 16,384 training samples; every run makes the same 10,240 gradient evaluations whatever N; mean over seeds; cells are test accuracy % / final training loss).\n", grid.seeds, grid.epochs);
    let mut first = None;
    for lr in &grid.lrs {
        let e = e1(grid, *lr, 100.0)?;
        let _ = writeln!(md, "## E1: momentum × staleness on the MLP\n\n{}", e1_table(&e));
        if first.is_none() {
            first = Some(e);
        }
    }
    let e = first.context("the grid has no learning rate")?;
    let shape1 = e1(&Grid { workers: vec![32], ..grid.clone() }, e.lr, 1.0)?;
    let _ = writeln!(md, "### E1 with exponential delays (shape 1), N = 32\n\n{}", e1_table(&shape1));
    let _ = writeln!(md, "### E1 pass criteria (docs/ALGORITHMS.md §7)\n");
    for (text, pass) in e1_criteria(&e, Some(&shape1)) {
        let _ = writeln!(md, "- {} {text}", if pass { "PASS" } else { "FAIL" });
    }
    let _ = writeln!(md, "\n![E1: test accuracy against workers](e1.svg)\n");
    std::fs::write(out.join("e1.svg"), svg_plot(&e)).context("writing e1.svg")?;

    let e6 = e6(grid)?;
    let _ = writeln!(md, "## E6: 256 workers\n\nThe E1 task and gradient budget (10,240 gradients whatever N) from 8 to 256 workers; cells are mean ± standard deviation over the seeds / final training loss. NAdam β1 0.99 is the published asynchronous-pipeline Nesterov update (η 5e-4); Delay-NAG our earlier reading of it (η 0.05); Gap-Adam the new rule (η 0.016; docs/ALGORITHMS.md §4.2).\n\n{}", e1_table(&e6));
    for (text, pass) in e6_criteria(&e6) {
        let _ = writeln!(md, "- {} {text}", if pass { "PASS" } else { "FAIL" });
    }
    let _ = writeln!(md);

    let _ = writeln!(md, "## E2: exact equivalences\n\n| check | measured | pass |\n|---|---|---|");
    for (check, measured, pass) in e2(5)? {
        let _ = writeln!(md, "| {check} | {measured} | {} |", if pass { "yes" } else { "NO" });
    }
    let _ = writeln!(md, "\n## E3: stability boundary on a quadratic (round-robin delay τ = N − 1)\n\nLargest stable η·h found by bisection (60,000 updates from x = 1, through the rules' kernels).\n\n| τ | delayed GD predicted | measured | heavy ball γ 0.9 predicted | measured | DANA-Zero γ 0.9 measured |\n|---|---|---|---|---|---|");
    for (tau, gd_p, gd_m, hb_p, hb_m, dana) in e3() {
        let _ = writeln!(md, "| {tau} | {gd_p:.4} | {gd_m:.4} | {hb_p:.4} | {hb_m:.4} | {dana:.4} |");
    }
    let _ = writeln!(md, "\n## E4: sync, GBA and async on a CTR model with stragglers\n\nHashed logistic regression on the synthetic Criteo data, its 2^16 bucket weights the rows of the shard's sparse table (each worker pulls its batch's rows and pushes their gradients per id; in sync and GBA the shard aggregates them per id over the global batch and drops a row read more than the threshold ago, in async it applies them on arrival), Adagrad η = 0.05 for every mode (the synchronous hyper-parameters), batch 64, 3 epochs of 65,536 samples, the first quarter of the workers 3× slower. GBA aggregates K = N gradients per update and drops those more than 4 steps stale. Test AUC and simulated wall-clock, mean over seeds.\n\n| N | mode | AUC | AUC − sync | simulated time | speed-up vs sync | mean staleness |\n|---|---|---|---|---|---|---|");
    let e4_rows = e4(&[8, 32], &grid.seeds)?;
    for r in &e4_rows {
        let sync =
            e4_rows.iter().find(|s| s.workers == r.workers && s.mode == super::SimMode::Sync).copied().unwrap_or(*r);
        let _ = writeln!(
            md,
            "| {} | {:?} | {:.4} | {:+.4} | {:.0} | {:.2}× | {:.1} |",
            r.workers,
            r.mode,
            r.auc,
            r.auc - sync.auc,
            r.wall,
            sync.wall / r.wall.max(1e-9),
            r.staleness
        );
    }
    let e5_lrs: Vec<f32> = if grid.lrs.len() > 1 { vec![0.01, 0.02, 0.04, 0.06, 0.08] } else { vec![0.02, 0.08] };
    let _ = writeln!(md, "\n## E5: elastic resize (SSGD, N alternating 8 ↔ 64 every 2 epochs)\n\nLinear learning-rate scaling applied at once, against the Dynamic mini-batch SGD ramp (the multiplier moves linearly to its new value over T = 8k rounds when the worker count grows k-fold). Test accuracy %, mean over seeds.\n\n| base η | immediate | ramp | ramp − immediate |\n|---|---|---|---|");
    for (lr, immediate, ramp) in e5(&e5_lrs, &grid.seeds)? {
        let _ = writeln!(md, "| {lr} | {immediate:.2} | {ramp:.2} | {:+.2} |", ramp - immediate);
    }
    let _ = writeln!(md, "\nTotal time: {:.0} s on this machine.", started.elapsed().as_secs_f64());
    std::fs::write(out.join("experiments.md"), &md).context("writing experiments.md")?;
    Ok(md)
}
