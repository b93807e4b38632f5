//! `gaps sim sweep`: how many workers are worth having.
//!
//! For every worker count N and training mode, one simulation (the same gradients in all: --epochs over
//! the training set) records the test metric a few times per epoch; the table gives the simulated time at
//! which the metric first reaches the target, the final metric, and for each mode the N that reached the
//! target soonest (the measured optimum). Beside it stands the delay analysis' prediction
//! (docs/ALGORITHMS.md §2, §7): asynchronous SGD with delay τ ≈ N − 1 on curvature h is stable while
//! η·h·N < π/2, so the largest useful N is about π/(2·η·h_max), with h_max the largest Hessian eigenvalue
//! of the task, estimated here by power iteration on finite-difference Hessian-vector products. For a
//! momentum rule the linear analysis would use the effective step η/(1 − γ) instead of η; both are printed
//! (on the E1 MLP the plain-η bound is the one that matches the measured optimum).

use crate::experiments::{mean, run_all, sd, svg_legend, svg_open, svg_series, COLORS};
use crate::tasks::Task;
use crate::{ModelChoice, SimArgs, SimMode, SimReport};
use anyhow::{bail, Result};
use gaps_common::rng::{mix, Rng};
use gaps_flags::HyperArgs;
use gaps_kernels::Rule;
use std::fmt::Write as _;
use std::path::PathBuf;

/// Flags of `gaps sim sweep`.
#[derive(Debug, Clone, clap::Args)]
pub struct SweepArgs {
    /// Worker counts to simulate.
    #[arg(long, env = "GAPS_SWEEP_WORKERS", value_delimiter = ',', default_value = "8,16,32,64", value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub workers: Vec<u32>,
    /// Training modes to simulate (sync, gba, async, ssp, auto).
    #[arg(long, env = "GAPS_SWEEP_MODES", value_enum, value_delimiter = ',', default_value = "sync,gba,async")]
    pub modes: Vec<SimMode>,
    /// The model to train.
    #[arg(long, env = "GAPS_SWEEP_MODEL", value_enum, default_value = "mlp")]
    pub model: ModelChoice,
    /// Update rule.
    #[arg(long, env = "GAPS_SWEEP_RULE", default_value = "momentum")]
    pub rule: Rule,
    /// Learning rate η (sync and gba scale it by N).
    #[arg(long, env = "GAPS_SWEEP_LR", default_value_t = 0.05)]
    pub lr: f32,
    /// The rule's other hyper-parameters: `gaps-server`'s flags (and `GAPS_*` variables), its defaults.
    #[command(flatten)]
    pub hyper: HyperArgs,
    /// Epochs over the training set (the same gradients for every N).
    #[arg(long, env = "GAPS_SWEEP_EPOCHS", default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub epochs: u32,
    /// Samples per gradient.
    #[arg(long, env = "GAPS_SWEEP_BATCH", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub batch: u32,
    /// Seeds: every cell runs once per seed and shows the mean ± standard deviation; the optimum N is
    /// given with each seed's own.
    #[arg(long = "seeds", alias = "seed", env = "GAPS_SWEEP_SEEDS", value_delimiter = ',', default_value = "1,2,3")]
    pub seeds: Vec<u64>,
    /// Gamma shape of the time per batch (ignored with --profile).
    #[arg(long, env = "GAPS_SWEEP_SHAPE", default_value_t = 100.0)]
    pub shape: f64,
    /// Replay this measured step log (`worker,seconds` lines) instead of the Gamma model.
    #[arg(long, env = "GAPS_SWEEP_PROFILE")]
    pub profile: Option<PathBuf>,
    /// A straggler `WORKER:FACTOR` (repeatable; applied for every N that has that worker).
    #[arg(long = "straggler", env = "GAPS_SWEEP_STRAGGLERS", value_delimiter = ',', value_parser = crate::parse_straggler)]
    pub stragglers: Vec<(u32, f64)>,
    /// The target test metric (default: 90 % of the best final metric of the sweep for accuracy and AUC (below
    /// the plateau of the peak learning rate, where the time to reach it would be noise),
    /// twice the best final loss for the quadratic).
    #[arg(long, env = "GAPS_SWEEP_TARGET")]
    pub target: Option<f64>,
    /// Test evaluations per epoch (the resolution of the time to target).
    #[arg(long, env = "GAPS_SWEEP_EVALS_PER_EPOCH", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub evals_per_epoch: u32,
    /// Keep η constant after the warm-up.
    #[arg(long, env = "GAPS_SWEEP_NO_LR_DECAY")]
    pub no_lr_decay: bool,
    /// Write the plot (time to target against N, one line per mode) to this SVG file.
    #[arg(long, env = "GAPS_SWEEP_SVG")]
    pub svg: Option<PathBuf>,
    /// End with one JSON line on stdout.
    #[arg(long, env = "GAPS_JSON")]
    pub json: bool,
}

impl SweepArgs {
    /// Defaults of every flag.
    pub fn defaults() -> Self {
        SweepArgs {
            workers: vec![8, 16, 32, 64],
            modes: vec![SimMode::Sync, SimMode::Gba, SimMode::Async],
            model: ModelChoice::Mlp,
            rule: Rule::Momentum,
            lr: 0.05,
            hyper: HyperArgs::default(),
            epochs: 20,
            batch: 32,
            seeds: vec![1, 2, 3],
            shape: 100.0,
            profile: None,
            stragglers: Vec::new(),
            target: None,
            evals_per_epoch: 4,
            no_lr_decay: false,
            svg: None,
            json: false,
        }
    }

    /// The simulation of one cell for one seed.
    fn sim(&self, workers: u32, mode: SimMode, seed: u64) -> SimArgs {
        SimArgs {
            model: self.model,
            rule: self.rule,
            workers,
            mode,
            lr: self.lr,
            hyper: self.hyper.clone(),
            epochs: self.epochs,
            batch: self.batch,
            seed,
            shape: self.shape,
            profile: self.profile.clone(),
            stragglers: self.stragglers.iter().copied().filter(|(w, _)| *w < workers).collect(),
            evals_per_epoch: self.evals_per_epoch,
            no_lr_decay: self.no_lr_decay,
            ..SimArgs::defaults()
        }
    }
}

/// One (N, mode) cell (in the JSON line as it is: NaN as null).
#[derive(Debug, Clone, serde::Serialize)]
pub struct SweepCell {
    /// Workers.
    pub workers: u32,
    /// Mode.
    pub mode: SimMode,
    /// Mean over the seeds of the simulated time at which the metric first reached the target (None
    /// unless every seed reached it).
    pub time_to_target: Option<f64>,
    /// Standard deviation of that time over the seeds (0 with one seed).
    pub time_sd: f64,
    /// Seeds whose run reached the target.
    pub reached: usize,
    /// Seeds run.
    pub seeds: usize,
    /// Seeds whose run diverged (left out of the final metric's mean).
    pub diverged: usize,
    /// Mean final test metric of the seeds that did not diverge (NaN when all diverged).
    pub final_metric: f64,
    /// Its standard deviation.
    pub final_sd: f64,
    /// Mean simulated time of the whole run.
    pub wall: f64,
}

/// The sweep's outcome; `gaps sim sweep --json` prints it as it is (NaN as null).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Sweep {
    /// The target metric.
    pub target: f64,
    /// True when the target was derived from the sweep (no --target).
    pub target_derived: bool,
    /// True when a larger metric is better (the target is reached from below).
    #[serde(skip)]
    pub higher_is_better: bool,
    /// What the metric is.
    #[serde(rename = "metric")]
    pub metric_name: &'static str,
    /// "units" or "seconds".
    pub time_unit: &'static str,
    /// Largest Hessian eigenvalue at the initial parameters.
    pub h_init: f64,
    /// Largest Hessian eigenvalue at the best run's final parameters.
    pub h_trained: f64,
    /// η.
    pub eta: f64,
    /// The rule's effective step.
    pub eta_eff: f64,
    /// π/(2·η·h_max): the delay analysis' largest useful N (docs/ALGORITHMS.md §7).
    pub bound: f64,
    /// π/(2·η_eff·h_max): the same with the momentum's effective step, the bound of a linear model.
    pub bound_momentum: f64,
    /// Per mode, the worker count that reached the target soonest.
    pub optimum: Vec<Optimum>,
    /// Every cell, by N then mode.
    pub cells: Vec<SweepCell>,
}

/// One mode's optimum in [`Sweep`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct Optimum {
    /// The mode.
    pub mode: SimMode,
    /// The N whose mean time to the target is least (None: no N reached it on every seed).
    pub workers: Option<u32>,
    /// Each seed's own optimum N, in the order of `--seeds` (the optimum's seed spread).
    pub per_seed: Vec<Option<u32>>,
}

/// The rule's effective step: η/(1 − γ) when a momentum buffer re-applies each gradient, η otherwise
/// (plain SGD, and the adaptive rules, whose step the bound describes only roughly).
pub fn effective_step(rule: Rule, lr: f32, momentum: f32) -> f64 {
    let with_momentum = !(rule == Rule::Sgd || rule.normalises_step());
    if with_momentum && momentum > 0.0 && momentum < 1.0 {
        f64::from(lr) / (1.0 - f64::from(momentum))
    } else {
        f64::from(lr)
    }
}

/// The largest Hessian eigenvalue of the task's training loss at `params`, by power iteration on central
/// finite differences of the gradient over (up to) 4,096 training samples: Hv ≈ (∇f(θ + εv) − ∇f(θ − εv))/2ε.
/// When the dominant eigenvalue is negative (a saddle), the iteration runs again on H + |λ|·I, whose
/// dominant eigenvalue is then the largest one shifted.
pub fn curvature(task: &dyn Task, params: &[f32], seed: u64) -> f64 {
    let batch: Vec<u32> = (0..task.train_size().min(4096) as u32).collect();
    let p = params.len();
    let (mut gp, mut gm) = (vec![0.0f32; p], vec![0.0f32; p]);
    let eps = 1e-3f32;
    let mut hv = |v: &[f64], out: &mut [f64]| {
        let plus: Vec<f32> = params.iter().zip(v).map(|(x, d)| x + eps * *d as f32).collect();
        let minus: Vec<f32> = params.iter().zip(v).map(|(x, d)| x - eps * *d as f32).collect();
        // The same batch id on both sides: a task's gradient noise cancels.
        task.loss_grad(&plus, &batch, 0, &mut gp);
        task.loss_grad(&minus, &batch, 0, &mut gm);
        for ((o, a), b) in out.iter_mut().zip(&gp).zip(&gm) {
            *o = f64::from(a - b) / (2.0 * f64::from(eps));
        }
    };
    let mut rng = Rng::new(mix(seed, 0x4e55));
    let mut iterate = |shift: f64| -> f64 {
        let mut v: Vec<f64> = (0..p).map(|_| rng.normal()).collect();
        let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-300);
        v.iter_mut().for_each(|x| *x /= norm);
        let mut w = vec![0.0f64; p];
        let mut lambda = 0.0;
        for _ in 0..50 {
            hv(&v, &mut w);
            w.iter_mut().zip(&v).for_each(|(w, v)| *w += shift * v);
            lambda = v.iter().zip(&w).map(|(a, b)| a * b).sum::<f64>();
            let norm = w.iter().map(|x| x * x).sum::<f64>().sqrt();
            if !(norm.is_finite() && norm > 0.0) {
                break;
            }
            v.iter_mut().zip(&w).for_each(|(v, w)| *v = w / norm);
        }
        lambda - shift
    };
    let top = iterate(0.0);
    if top >= 0.0 {
        top
    } else {
        iterate(-top)
    }
}

fn better(task_higher: bool, a: f64, b: f64) -> bool {
    if task_higher {
        a > b
    } else {
        a < b
    }
}

/// Runs the sweep (all cells on all cores) and the curvature estimate.
pub fn run(args: &SweepArgs) -> Result<Sweep> {
    if args.workers.is_empty() || args.modes.is_empty() {
        bail!("--workers and --modes need at least one value each");
    }
    let mut workers = args.workers.clone();
    workers.sort_unstable();
    workers.dedup();
    if args.seeds.is_empty() {
        bail!("--seeds needs at least one seed");
    }
    let seeds = args.seeds.len();
    let grid: Vec<(u32, SimMode)> = workers.iter().flat_map(|n| args.modes.iter().map(move |m| (*n, *m))).collect();
    let jobs: Vec<SimArgs> =
        grid.iter().flat_map(|(n, m)| args.seeds.iter().map(move |seed| args.sim(*n, *m, *seed))).collect();
    for job in &jobs {
        job.validate()?;
    }
    let reports = run_all(jobs)?;
    let first_seed = args.seeds[0];
    let task = args.sim(workers[0], args.modes[0], first_seed).task();
    let higher = task.higher_is_better();
    let best =
        reports.iter().filter(|r| !r.diverged && r.final_test_metric.is_finite()).fold(None::<&SimReport>, |b, r| {
            match b {
                Some(b) if !better(higher, r.final_test_metric, b.final_test_metric) => Some(b),
                _ => Some(r),
            }
        });
    let (target, target_derived) = match (args.target, best) {
        (Some(t), _) => (t, false),
        (None, Some(b)) if higher => (0.90 * b.final_test_metric, true),
        (None, Some(b)) => (2.0 * b.final_test_metric, true),
        (None, None) => bail!("every run of the sweep diverged; try a smaller --lr"),
    };
    if !target.is_finite() {
        bail!("--target must be finite");
    }
    // Per cell, each seed's time to the target (reports are by cell, then seed).
    let times: Vec<Vec<Option<f64>>> = reports
        .chunks(seeds)
        .map(|runs| runs.iter().map(|r| crate::time_to_reach(&r.curve, target, higher)).collect())
        .collect();
    let cells: Vec<SweepCell> = grid
        .iter()
        .zip(reports.chunks(seeds))
        .zip(&times)
        .map(|(((n, m), runs), t)| {
            let reached: Vec<f64> = t.iter().flatten().copied().collect();
            let finals: Vec<f64> = runs.iter().filter(|r| !r.diverged).map(|r| r.final_test_metric).collect();
            let (final_metric, final_sd) =
                if finals.is_empty() { (f64::NAN, f64::NAN) } else { (mean(&finals), sd(&finals)) };
            SweepCell {
                workers: *n,
                mode: *m,
                diverged: seeds - finals.len(),
                time_to_target: (reached.len() == seeds).then(|| mean(&reached)),
                time_sd: sd(&reached),
                reached: reached.len(),
                seeds,
                final_metric,
                final_sd,
                wall: mean(&runs.iter().map(|r| r.sim_wall_time).collect::<Vec<_>>()),
            }
        })
        .collect();
    let init = task.init(first_seed);
    let h_init = curvature(task.as_ref(), &init, first_seed);
    // At the best run's parameters, on that run's own data (the tasks' data depend on the seed).
    let h_trained = best.map_or(f64::NAN, |b| {
        curvature(args.sim(workers[0], args.modes[0], b.seed).task().as_ref(), &b.params, b.seed)
    });
    let h_max = h_init.max(if h_trained.is_finite() { h_trained } else { 0.0 });
    let eta_eff = effective_step(args.rule, args.lr, args.hyper.momentum);
    let eta = f64::from(args.lr);
    let bound = std::f64::consts::PI / (2.0 * eta * h_max);
    let bound_momentum = std::f64::consts::PI / (2.0 * eta_eff * h_max);
    let optimum = optima(&args.modes, &grid, &cells, &times, seeds);
    Ok(Sweep {
        cells,
        target,
        target_derived,
        higher_is_better: higher,
        metric_name: task.metric_name(),
        h_init,
        h_trained,
        eta_eff,
        eta,
        bound,
        bound_momentum,
        optimum,
        time_unit: reports.first().map_or("units", |r| r.time_unit),
    })
}

/// A time with three significant digits or more (no decimals past 100).
fn short(t: f64) -> String {
    if t >= 100.0 {
        format!("{t:.0}")
    } else if t >= 10.0 {
        format!("{t:.1}")
    } else {
        format!("{t:.2}")
    }
}

fn mode_name(m: SimMode) -> &'static str {
    match m {
        SimMode::Async => "async",
        SimMode::Gba => "gba",
        SimMode::Ssp => "ssp",
        SimMode::Auto => "auto",
        SimMode::Sync => "sync",
    }
}

impl Sweep {
    fn modes(&self) -> Vec<SimMode> {
        self.optimum.iter().map(|o| o.mode).collect()
    }

    fn workers(&self) -> Vec<u32> {
        let mut w: Vec<u32> = self.cells.iter().map(|c| c.workers).collect();
        w.dedup();
        w
    }

    fn cell(&self, n: u32, m: SimMode) -> Option<&SweepCell> {
        self.cells.iter().find(|c| c.workers == n && c.mode == m)
    }

    /// The markdown table and the bound beside the measured optimum.
    pub fn markdown(&self, args: &SweepArgs) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{} `{}`, η {}, γ {}, {} epochs of batch {}, seeds {:?} (each cell: mean ± sd over them); timings: {}.\n",
            self.metric_name,
            args.rule,
            args.lr,
            args.hyper.momentum,
            args.epochs,
            args.batch,
            args.seeds,
            match &args.profile {
                Some(p) => format!("replayed from {} (seconds)", p.display()),
                None => format!("Gamma shape {} (a batch takes {} units on average)", args.shape, args.batch),
            }
        );
        let _ = writeln!(
            s,
            "Target: {} {} {:.4}{}. Each cell: simulated time to the target ({}) / final metric.\n",
            self.metric_name,
            if self.higher_is_better { "≥" } else { "≤" },
            self.target,
            if self.target_derived { " (derived from the best final metric of the sweep)" } else { "" },
            self.time_unit
        );
        let modes = self.modes();
        let _ = write!(s, "| N |");
        for m in &modes {
            let _ = write!(s, " {} |", mode_name(*m));
        }
        let _ = write!(s, "\n|---|");
        for _ in &modes {
            let _ = write!(s, "---|");
        }
        s.push('\n');
        for n in self.workers() {
            let _ = write!(s, "| {n} |");
            for m in &modes {
                match self.cell(n, *m) {
                    Some(c) => {
                        let t = match c.time_to_target {
                            Some(t) if c.seeds > 1 => format!("{} ± {}", short(t), short(c.time_sd)),
                            Some(t) => short(t),
                            None if c.reached > 0 => format!("never ({} of {} seeds reached it)", c.reached, c.seeds),
                            None => "never".to_string(),
                        };
                        let mut f = match (c.final_metric.is_finite(), c.seeds > 1) {
                            (true, true) => format!("{:.2} ± {:.2}", c.final_metric, c.final_sd),
                            (true, false) => format!("{:.3}", c.final_metric),
                            (false, _) => "diverged".into(),
                        };
                        if c.diverged > 0 && c.final_metric.is_finite() {
                            f.push_str(&format!(" (diverged {}/{})", c.diverged, c.seeds));
                        }
                        let _ = write!(s, " {t} / {f} |");
                    }
                    None => s.push_str(" – |"),
                }
            }
            s.push('\n');
        }
        let _ = writeln!(
            s,
            "\nStability bound of the delay analysis: N* ≈ π/(2·η·h_max) = **{:.1}** with η = {:.4} and h_max = {:.3} \
             (power iteration: {:.3} at the initial parameters, {:.3} at the best run's final ones); with the \
             momentum's effective step η/(1 − γ) = {:.3} instead, as for a linear model, N* ≈ {:.1}.",
            self.bound,
            self.eta,
            self.h_init.max(self.h_trained),
            self.h_init,
            self.h_trained,
            self.eta_eff,
            self.bound_momentum
        );
        let opt: Vec<String> = self
            .optimum
            .iter()
            .map(|o| {
                let each: Vec<String> =
                    o.per_seed.iter().map(|n| n.map_or("none".to_string(), |n| n.to_string())).collect();
                format!(
                    "{} {} (each seed's: {})",
                    mode_name(o.mode),
                    o.workers.map_or("none reached the target on every seed".into(), |n| format!("N = {n}")),
                    each.join(", ")
                )
            })
            .collect();
        let _ = writeln!(s, "Measured optimum (least time to the target): {}.", opt.join(", "));
        s
    }

    /// The JSON line: the sweep as it is.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"error\":\"the sweep did not encode: {e}\"}}"))
    }

    /// Time to target against N (both log scale), one line per mode, the bound as a dashed vertical line.
    pub fn svg(&self) -> String {
        let (w, h, left, right, top, bottom) = (740.0, 420.0, 70.0, 170.0, 30.0, 50.0);
        let (pw, ph) = (w - left - right, h - top - bottom);
        let workers = self.workers();
        let lx = |n: f64| n.log2();
        let (xmin, xmax) = (
            lx(f64::from(*workers.first().unwrap_or(&1))).min(lx(self.bound.max(1.0))),
            lx(f64::from(*workers.last().unwrap_or(&2))).max(lx(self.bound.max(1.0))),
        );
        let x = |n: f64| left + (lx(n) - xmin) / (xmax - xmin).max(1e-9) * pw;
        let times: Vec<f64> = self.cells.iter().filter_map(|c| c.time_to_target).filter(|t| *t > 0.0).collect();
        let tmin = times.iter().copied().fold(f64::INFINITY, f64::min);
        let tmax = times.iter().copied().fold(0.0, f64::max);
        let (tmin, tmax) = if times.is_empty() { (1.0, 10.0) } else { (tmin / 1.3, tmax * 1.3) };
        let y = |t: f64| top + (1.0 - (t.ln() - tmin.ln()) / (tmax.ln() - tmin.ln()).max(1e-9)) * ph;
        let title = format!("Simulated time to {} {:.3} vs workers", self.metric_name, self.target);
        let mut s = svg_open(w, h, left + pw / 2.0, &title);
        // Decade-ish grid on the time axis: 5 lines, labelled.
        for k in 0..=4 {
            let t = (tmin.ln() + (tmax.ln() - tmin.ln()) * f64::from(k) / 4.0).exp();
            let yy = y(t);
            let _ = writeln!(
                s,
                r##"<line x1="{left}" y1="{yy:.1}" x2="{}" y2="{yy:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
                left + pw,
                left - 6.0,
                yy + 4.0,
                short(t)
            );
        }
        for n in &workers {
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{}" text-anchor="middle">{n}</text>"#,
                x(f64::from(*n)),
                top + ph + 18.0
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">workers N (log scale); time to target ({}, log scale)</text>"#,
            left + pw / 2.0,
            h - 10.0,
            self.time_unit
        );
        if self.bound.is_finite() && self.bound > 0.0 {
            let bx = x(self.bound.max(1.0));
            let _ = writeln!(
                s,
                r##"<line x1="{bx:.1}" y1="{top}" x2="{bx:.1}" y2="{}" stroke="#444" stroke-dasharray="5 4"/><text x="{:.1}" y="{}" fill="#444">N* ≈ {:.1}</text>"##,
                top + ph,
                bx + 4.0,
                top + 14.0,
                self.bound
            );
        }
        for (i, m) in self.modes().iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let pts: Vec<(f64, f64)> = workers
                .iter()
                .filter_map(|n| self.cell(*n, *m).and_then(|c| c.time_to_target).map(|t| (x(f64::from(*n)), y(t))))
                .collect();
            svg_series(&mut s, color, &pts);
            for n in &workers {
                if self.cell(*n, *m).is_some_and(|c| c.time_to_target.is_none()) {
                    let _ = writeln!(
                        s,
                        r#"<text x="{:.1}" y="{:.1}" fill="{color}" text-anchor="middle">× never</text>"#,
                        x(f64::from(*n)),
                        top + 12.0 + 14.0 * i as f64
                    );
                }
            }
            svg_legend(&mut s, left + pw + 40.0, top + 10.0 + i as f64 * 18.0, color, mode_name(*m));
        }
        s.push_str("</svg>\n");
        s
    }
}

/// Per mode, the worker count that reached the target soonest: on the seeds' mean, and for each seed.
fn optima(
    modes: &[SimMode],
    grid: &[(u32, SimMode)],
    cells: &[SweepCell],
    times: &[Vec<Option<f64>>],
    seeds: usize,
) -> Vec<Optimum> {
    modes
        .iter()
        .map(|m| {
            let best = cells
                .iter()
                .filter(|c| c.mode == *m)
                .filter_map(|c| c.time_to_target.map(|t| (t, c.workers)))
                .min_by(|a, b| a.0.total_cmp(&b.0));
            let per_seed = (0..seeds)
                .map(|k| {
                    grid.iter()
                        .zip(times)
                        .filter(|((_, mode), _)| mode == m)
                        .filter_map(|((n, _), t)| t[k].map(|t| (t, *n)))
                        .min_by(|a, b| a.0.total_cmp(&b.0))
                        .map(|(_, n)| n)
                })
                .collect();
            Optimum { mode: *m, workers: best.map(|(_, n)| n), per_seed }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tasks::Quadratic;

    #[test]
    fn power_iteration_finds_the_quadratics_top_curvature() {
        // h is log-spaced over [1e-3, 1]: the top eigenvalue is 1 exactly.
        let q = Quadratic::new(50, 0.5, 3, 1024);
        let x = vec![0.7f32; 50];
        let h = curvature(&q, &x, 1);
        assert!((h - 1.0).abs() < 0.02, "h_max {h}");
    }

    #[test]
    fn effective_steps() {
        assert!((effective_step(Rule::Momentum, 0.05, 0.9) - 0.5).abs() < 1e-6);
        assert!((effective_step(Rule::Sgd, 0.05, 0.9) - 0.05).abs() < 1e-9);
        assert!((effective_step(Rule::Adagrad, 0.05, 0.9) - 0.05).abs() < 1e-9);
    }
}
