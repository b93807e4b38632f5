//! Kernel tests on fresh random inputs (never zeros): the fast path against the reference, the exact
//! equivalences of docs/ALGORITHMS.md §7 E2, and the stability boundaries of E3.

use super::*;
use crate::reference::State;

/// Deterministic uniform values in [lo, hi).
pub(crate) fn random(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            lo + (hi - lo) * ((s >> 40) as f32 / (1u64 << 24) as f32)
        })
        .collect()
}

fn random_state(rule: Rule, n: usize, seed: u64) -> State {
    let l = rule.layout();
    let mut shared = random(l.shared_planes * n, seed + 1, -0.5, 0.5);
    // Second-moment planes (Gap-Aware's EMA, Adam's v) and Adagrad's accumulator are non-negative.
    match rule {
        Rule::GapAware | Rule::DanaGa | Rule::Adam | Rule::Nadam | Rule::GapAdam => {
            shared[n..].iter_mut().for_each(|x| *x = x.abs())
        }
        Rule::Adagrad => shared.iter_mut().for_each(|x| *x = x.abs()),
        _ => {}
    }
    let mut worker = random(l.worker_planes * n, seed + 2, -0.5, 0.5);
    if rule == Rule::DcAsgdAdaptive {
        worker.iter_mut().for_each(|x| *x = x.abs());
    }
    State { params: random(n, seed, -1.0, 1.0), shared, worker }
}

fn hyper() -> Hyper {
    Hyper { lr: 0.05, momentum: 0.9, weight_decay: 1e-3, dc_lambda: 2.0, dc_ms_decay: 0.95 }
}

fn fast_step(rule: Rule, h: &Hyper, s: &PushScalars, st: &mut State, grad: &[f32], read: &[f32], threads: usize) {
    let read = if rule.layout().needs_read { read } else { &[] };
    let bufs = Bufs::from_planes(&mut st.params, &mut st.shared, &mut st.worker, grad, read);
    apply_par(rule, h, s, bufs, threads).expect("apply");
}

fn assert_close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let tol = 1e-6 * y.abs().max(1e-3);
        assert!((x - y).abs() <= tol, "{what}[{i}]: fast {x} vs reference {y}");
    }
}

fn check_against_reference(n: usize, threads: usize) {
    for (r, rule) in Rule::ALL.into_iter().enumerate() {
        let h = hyper();
        let mut fast = random_state(rule, n, 10 * r as u64 + 1);
        let mut reference = fast.clone();
        for step in 0..4u64 {
            let grad = random(n, 1000 + step, -1.0, 1.0);
            // The read parameters differ from θ by a small random drift, as after a few other updates.
            let drift = random(n, 2000 + step, -0.01, 0.01);
            let read: Vec<f32> = reference.params.iter().zip(&drift).map(|(p, d)| p + d).collect();
            let s = PushScalars { lr: 0.05, lr_max: 0.08, staleness: step * 3 + 1, t: step + 1, workers: 6 };
            fast_step(rule, &h, &s, &mut fast, &grad, &read, threads);
            reference::apply(rule, &h, &s, &mut reference, &grad, &read);
        }
        assert_close(&fast.params, &reference.params, &format!("{rule} params"));
        assert_close(&fast.shared, &reference.shared, &format!("{rule} shared"));
        assert_close(&fast.worker, &reference.worker, &format!("{rule} worker"));
        assert_ne!(fast.params, random_state(rule, n, 10 * r as u64 + 1).params, "{rule} changed nothing");
    }
}

#[test]
fn fast_path_matches_the_reference_for_every_rule() {
    check_against_reference(1003, 1);
}

#[test]
fn threaded_fast_path_matches_the_reference_for_every_rule() {
    check_against_reference(PAR_MIN_PARAMS * 2 + 13, 3);
}

#[test]
fn gap_aware_at_zero_staleness_is_momentum_bit_for_bit() {
    let n = 4096;
    let h = hyper();
    let mut ga = random_state(Rule::GapAware, n, 5);
    let mut mom = State { params: ga.params.clone(), shared: ga.shared[..n].to_vec(), worker: vec![] };
    let mut sa = mom.clone();
    for step in 0..20u64 {
        let grad = random(n, 300 + step, -1.0, 1.0);
        let read = ga.params.clone(); // nothing moved since the read: Δ = 0, G = 1
        let s = PushScalars { lr: 0.05, lr_max: 0.05, staleness: 0, t: step + 1, workers: 1 };
        fast_step(Rule::GapAware, &h, &s, &mut ga, &grad, &read, 1);
        fast_step(Rule::Momentum, &h, &s, &mut mom, &grad, &[], 1);
        // Staleness-aware with τ ≤ 1 is momentum too.
        fast_step(Rule::StalenessAware, &h, &PushScalars { staleness: 1, ..s }, &mut sa, &grad, &[], 1);
    }
    assert_eq!(ga.params, mom.params);
    assert_eq!(&ga.shared[..n], &mom.shared[..]);
    assert_eq!(sa.params, mom.params);
}

#[test]
fn delay_nesterov_with_one_worker_is_nesterov_and_grows_its_momentum_with_the_delay() {
    // One worker, no delay: the look-ahead pulls follow Nesterov (Bengio form) with the gradient taken at
    // the pulled point, as for DANA-Zero at N = 1.
    let (n, h) = (512usize, Hyper { weight_decay: 0.0, ..hyper() });
    let curvature = random(n, 31, 1e-3, 1.0);
    let theta0 = random(n, 32, -1.0, 1.0);
    let mut delayed = State { params: theta0.clone(), shared: vec![0.0; n], worker: vec![] };
    let mut nesterov = State { params: theta0, shared: vec![0.0; n], worker: vec![] };
    for step in 0..200u64 {
        let s = PushScalars { lr: h.lr, lr_max: h.lr, staleness: 0, t: step + 1, workers: 1 };
        let mut view = Vec::with_capacity(n);
        pull_values(Rule::DelayNesterov, &h, h.lr, 1, &delayed.params, &delayed.shared, &mut view);
        fast_step(Rule::DelayNesterov, &h, &s, &mut delayed, &quadratic_grad(&view, &curvature, step), &[], 1);
        let grad = quadratic_grad(&nesterov.params, &curvature, step);
        fast_step(Rule::Nesterov, &h, &s, &mut nesterov, &grad, &[], 1);
    }
    let mut view = Vec::with_capacity(n);
    pull_values(Rule::DelayNesterov, &h, h.lr, 1, &delayed.params, &delayed.shared, &mut view);
    for (i, (a, b)) in view.iter().zip(&nesterov.params).enumerate() {
        assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0), "θ̂[{i}]: {a} vs Nesterov's {b}");
    }
    // The look-ahead extrapolates over N updates of η/(1−γ)·m: with m = 1, η = 0.05, γ = 0.9, N = 8 it
    // is 0.05/0.1 · 0.9 · 8 = 3.6 below θ.
    let mut out = Vec::new();
    pull_values(Rule::DelayNesterov, &h, 0.05, 8, &[0.0], &[1.0], &mut out);
    assert!((out[0] + 3.6).abs() < 1e-5, "{}", out[0]);
    // γ_τ: the base momentum without delay, linear in τ up to 0.99 at τ = N, never beyond.
    assert_eq!(delay_momentum(0.9, 0, 8), 0.9);
    assert!((delay_momentum(0.9, 4, 8) - 0.945).abs() < 1e-6);
    assert!((delay_momentum(0.9, 8, 8) - 0.99).abs() < 1e-6);
    assert!((delay_momentum(0.9, 1000, 8) - 0.99).abs() < 1e-6);
    assert_eq!(delay_momentum(0.995, 50, 8), 0.995);
    assert!((delay_momentum(0.0, 3, 0) - 0.99).abs() < 1e-6, "no workers counts as one");
    // A stale gradient enters the average with weight 1 − γ_τ: the step stays η/(1−γ)·m whatever γ_τ.
    let mut one = State { params: vec![0.0; 1], shared: vec![0.0; 1], worker: vec![] };
    let s = PushScalars { lr: 0.05, lr_max: 0.05, staleness: 9, t: 1, workers: 8 };
    fast_step(Rule::DelayNesterov, &h, &s, &mut one, &[1.0], &[], 1);
    let expected = -0.05 / 0.1 * (1.0 - 0.99f32);
    assert!((one.params[0] - expected).abs() < 1e-6, "{} vs {expected}", one.params[0]);
}

/// Gradient of ½Σ h_j x_j² plus deterministic noise, evaluated at `x`.
fn quadratic_grad(x: &[f32], h: &[f32], step: u64) -> Vec<f32> {
    let noise = random(x.len(), 50_000 + step, -0.01, 0.01);
    x.iter().zip(h).zip(&noise).map(|((x, h), e)| h * x + e).collect()
}

#[test]
fn dana_slim_equals_dana_zero_lookahead_at_constant_lr() {
    // docs/ALGORITHMS.md §7 E2: N = 16 workers in round-robin order, constant η, 5 "epochs" of 64 pushes each.
    let (n, workers) = (256usize, 16usize);
    let h = Hyper { lr: 0.05, momentum: 0.9, weight_decay: 0.0, ..hyper() };
    let curvature: Vec<f32> = random(n, 7, 1e-3, 1.0);
    let theta0 = random(n, 8, -1.0, 1.0);
    // DANA-Zero: master θ, S, per-worker momenta; each worker holds the look-ahead it was sent.
    let mut zero = State { params: theta0.clone(), shared: vec![0.0; n], worker: vec![] };
    let mut zero_momenta = vec![vec![0.0f32; n]; workers];
    let mut zero_views = vec![theta0.clone(); workers];
    // DANA-Slim: master Θ only; each worker holds its momentum and the Θ it was sent.
    let mut slim = State { params: theta0.clone(), shared: vec![], worker: vec![] };
    let mut slim_momenta = vec![vec![0.0f32; n]; workers];
    let mut slim_views = vec![theta0; workers];
    let mut worst = 0.0f32;
    for step in 0..(5 * 64) as u64 {
        let i = step as usize % workers;
        let s = PushScalars::fresh(h.lr, step + 1);
        let g = quadratic_grad(&zero_views[i], &curvature, step);
        let bufs = Bufs {
            params: &mut zero.params,
            s0: &mut zero.shared,
            s1: &mut [],
            w0: &mut zero_momenta[i],
            grad: &g,
            read: &[],
        };
        apply(Rule::DanaZero, &h, &s, bufs).expect("zero");
        let mut view = Vec::with_capacity(n);
        pull_values(Rule::DanaZero, &h, h.lr, workers as u32, &zero.params, &zero.shared, &mut view);
        zero_views[i] = view;

        let mut u = quadratic_grad(&slim_views[i], &curvature, step);
        slim_worker_step(&h, &slim_views[i], &mut slim_momenta[i], &mut u);
        let bufs = Bufs { params: &mut slim.params, s0: &mut [], s1: &mut [], w0: &mut [], grad: &u, read: &[] };
        apply(Rule::DanaSlim, &h, &s, bufs).expect("slim");
        slim_views[i] = slim.params.clone();

        let lookahead = &zero_views[i];
        for (a, b) in slim.params.iter().zip(lookahead) {
            worst = worst.max((a - b).abs());
        }
    }
    let scale = slim.params.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    eprintln!("E2: max abs(slim - zero look-ahead) = {worst:e}, max abs(theta) = {scale}");
    assert!(worst <= 2e-5 * scale.max(1.0), "max |Θ_slim − θ̂_zero| = {worst} (|θ| ≤ {scale})");
}

/// Runs x_{t+1} = x_t − η·v_{t+1}, v_{t+1} = γv_t + h·x_{t−τ} (the delayed gradient) through a rule's
/// kernel for `steps` steps from x = 1; returns |x| at the end.
fn delayed_run(rule: Rule, gamma: f32, eta_h: f32, tau: usize, steps: usize) -> f32 {
    let h = Hyper { lr: eta_h, momentum: gamma, weight_decay: 0.0, ..hyper() };
    let mut x = [1.0f32];
    let mut v = [0.0f32];
    let mut history = std::collections::VecDeque::from(vec![1.0f32; tau + 1]);
    for t in 0..steps {
        let delayed = history.pop_front().unwrap_or(0.0);
        let g = [delayed]; // curvature h = 1, so η·h = η
        let s = PushScalars::fresh(h.lr, t as u64 + 1);
        let shared: &mut [f32] = if rule == Rule::Sgd { &mut [] } else { &mut v };
        apply(rule, &h, &s, Bufs { params: &mut x, s0: shared, s1: &mut [], w0: &mut [], grad: &g, read: &[] })
            .expect("apply");
        history.push_back(x[0]);
        if !x[0].is_finite() || x[0].abs() > 1e6 {
            return f32::INFINITY;
        }
    }
    x[0].abs()
}

#[test]
fn stability_boundaries_of_delayed_gd_and_heavy_ball_land_where_e3_predicts() {
    for tau in [7usize, 15, 31] {
        let critical = 2.0 * (std::f32::consts::PI / (2.0 * (2.0 * tau as f32 + 1.0))).sin();
        let below = delayed_run(Rule::Sgd, 0.0, 0.95 * critical, tau, 40_000);
        let above = delayed_run(Rule::Sgd, 0.0, 1.05 * critical, tau, 40_000);
        assert!(below < 1e-2, "τ={tau}: plain delayed GD at 0.95× the bound should converge, |x| = {below}");
        assert!(above > 1.0, "τ={tau}: plain delayed GD at 1.05× the bound should diverge, |x| = {above}");
    }
    // Heavy ball with γ = 0.9 at the master: the bound drops to ≈ 0.0159 / 0.0079 / 0.0042.
    for (tau, critical) in [(7usize, 0.0159f32), (15, 0.0079), (31, 0.0042)] {
        let below = delayed_run(Rule::Momentum, 0.9, 0.9 * critical, tau, 100_000);
        let above = delayed_run(Rule::Momentum, 0.9, 1.1 * critical, tau, 100_000);
        assert!(below < 1e-2, "τ={tau}: heavy ball at 0.9× the bound should converge, |x| = {below}");
        assert!(above > 1.0, "τ={tau}: heavy ball at 1.1× the bound should diverge, |x| = {above}");
    }
}

#[test]
fn names_parse_and_bad_input_is_refused() {
    for rule in Rule::ALL {
        assert_eq!(rule.name().parse::<Rule>().expect("parse"), rule);
    }
    assert!(matches!("adamw".parse::<Rule>(), Err(KernelError::UnknownRule(_))));
    assert!(Hyper { lr: -1.0, ..Hyper::default() }.validate().is_err());
    assert!(Hyper { lr: f32::NAN, ..Hyper::default() }.validate().is_err());
    assert!(Hyper { momentum: 1.0, ..Hyper::default() }.validate().is_err());
    assert!(Hyper { dc_lambda: -2.0, ..Hyper::default() }.validate().is_err());
    let mut p = vec![0.5; 3];
    let s = PushScalars::fresh(0.1, 1);
    let no_state = Bufs { params: &mut p, s0: &mut [], s1: &mut [], w0: &mut [], grad: &[0.1; 3], read: &[] };
    assert!(matches!(apply(Rule::Momentum, &Hyper::default(), &s, no_state), Err(KernelError::Length { .. })));
    let mut v = vec![0.0; 3];
    let no_read = Bufs { params: &mut p, s0: &mut v, s1: &mut [], w0: &mut [], grad: &[0.1; 3], read: &[] };
    assert!(matches!(apply(Rule::DcAsgd, &Hyper::default(), &s, no_read), Err(KernelError::Length { .. })));
}

/// Every instruction-set path this CPU has (the baseline, AVX2's compiled loops, AVX-512's loops with the
/// refined reciprocal and square-root estimates) against the reference, on a length with a tail, with
/// zeros and subnormals in the gradients and the second-moment planes (where an estimate of 1/√0 is ∞).
#[test]
fn every_instruction_set_matches_the_reference_with_zeros_and_subnormals() {
    let n = 16 * 37 + 5;
    let h = hyper();
    let paths: Vec<Isa> =
        [Isa::Baseline, Isa::Avx2, Isa::Avx512].into_iter().filter(|which| *which <= detected()).collect();
    for which in paths {
        for (r, rule) in Rule::ALL.into_iter().enumerate() {
            let mut fast = random_state(rule, n, 40 * r as u64 + 3);
            let l = rule.layout();
            for (i, x) in fast.shared.iter_mut().chain(fast.worker.iter_mut()).enumerate() {
                match i % 7 {
                    0 => *x = 0.0,
                    // A subnormal where the value was positive (second-moment planes stay ≥ 0).
                    3 => *x = 1e-40 * x.signum().max(0.0),
                    _ => {}
                }
            }
            let mut reference = fast.clone();
            for step in 0..3u64 {
                let mut grad = random(n, 500 + step, -1.0, 1.0);
                grad.iter_mut().step_by(5).for_each(|g| *g = 0.0);
                grad.iter_mut().skip(2).step_by(11).for_each(|g| *g = 3e-39);
                let mut read = reference.params.clone();
                // Half the read parameters equal θ (no drift: Gap-Aware's penalty is exactly 1).
                read.iter_mut().zip(random(n, 600 + step, -0.01, 0.01)).skip(1).step_by(2).for_each(|(p, d)| *p += d);
                let s = PushScalars { lr: 0.05, lr_max: 0.08, staleness: step + 1, t: step + 1, workers: 3 };
                let read_used: &[f32] = if l.needs_read { &read } else { &[] };
                let k = derive(rule, &h, &s);
                let bufs = Bufs::from_planes(&mut fast.params, &mut fast.shared, &mut fast.worker, &grad, read_used);
                fast::apply_with(which, rule, &k, n, bufs);
                reference::apply(rule, &h, &s, &mut reference, &grad, &read);
            }
            let what = |plane: &str| format!("{which:?} {rule} {plane}");
            assert_close(&fast.params, &reference.params, &what("params"));
            assert_close(&fast.shared, &reference.shared, &what("shared"));
            assert_close(&fast.worker, &reference.worker, &what("worker"));
            assert!(fast.params.iter().chain(&fast.shared).chain(&fast.worker).all(|x| x.is_finite()));
        }
    }
}

/// NAdam against PyTorch 2.15's `torch.optim.NAdam` (float64; lr 0.01, betas (0.99, 0.999), eps 1e-8,
/// weight_decay 0.01 with decoupled_weight_decay=True, momentum_decay 0.004): five steps of fixed gradients
/// from [0.5, −1.25, 2, 0]. The expected values were printed by PyTorch, not by this crate.
#[test]
fn nadam_follows_pytorch_nadam() {
    let grads = [
        [0.3f32, -0.2, 1.5, -0.7],
        [0.1, 0.4, -0.5, 0.2],
        [-0.6, 0.05, 0.9, 0.3],
        [0.2, -0.3, 0.1, -0.1],
        [0.8, 0.6, -1.2, 0.4],
    ];
    let want_params = [0.48359494276879006f64, -1.2517057716300073, 1.9925233830402416, -0.00011274675711329557];
    let want_m = [0.007951487030000008f64, 0.005480053980000004, 0.007368345150000006, 0.001166725930000002];
    let want_v = [0.001138850929630091f64, 0.0006517657221800405, 0.004748635050752254, 0.0007877331480004905];
    let h = Hyper { lr: 0.01, momentum: 0.99, weight_decay: 0.01, ..Hyper::default() };
    let start = State { params: vec![0.5, -1.25, 2.0, 0.0], shared: vec![0.0; 8], worker: Vec::new() };
    let (mut fast, mut oracle) = (start.clone(), start);
    for (t, g) in grads.iter().enumerate() {
        let s = PushScalars::fresh(0.01, t as u64 + 1);
        fast_step(Rule::Nadam, &h, &s, &mut fast, g, &[], 1);
        reference::apply(Rule::Nadam, &h, &s, &mut oracle, g, &[]);
    }
    for (name, st) in [("fast", &fast), ("reference", &oracle)] {
        for i in 0..4 {
            let close = |got: f32, want: f64, tol: f64| (f64::from(got) - want).abs() <= tol * want.abs().max(1e-3);
            assert!(close(st.params[i], want_params[i], 2e-5), "{name} θ[{i}] {} vs {}", st.params[i], want_params[i]);
            assert!(close(st.shared[i], want_m[i], 1e-4), "{name} m[{i}] {} vs {}", st.shared[i], want_m[i]);
            assert!(close(st.shared[4 + i], want_v[i], 1e-4), "{name} v[{i}] {} vs {}", st.shared[4 + i], want_v[i]);
        }
    }
}

/// Gap-Adam: with no drift the penalty is 1 and the rule is Adam with β1 = `momentum` and no first-moment
/// bias correction; a parameter that moved k·η since the read gets its gradient divided by (1 + k)^1.5 in
/// the first moment, while the second moment sees the whole gradient.
#[test]
fn gap_adam_penalises_by_the_steps_a_parameter_moved() {
    let h = Hyper { lr: 0.01, momentum: 0.9, weight_decay: 0.0, ..Hyper::default() };
    let s = PushScalars { lr: 0.01, lr_max: 0.02, staleness: 5, t: 1, workers: 4 };
    let mut st = State { params: vec![1.0, 1.0], shared: vec![0.0; 4], worker: Vec::new() };
    // Parameter 0 was read where it is (no drift); parameter 1 was read 3·η_max away.
    fast_step(Rule::GapAdam, &h, &s, &mut st, &[0.5, 0.5], &[1.0, 1.0 - 0.06], 1);
    let v = (1.0 - ADAM_BETA2) * 0.25;
    let denom = (v / (1.0 - ADAM_BETA2)).sqrt() + ADA_EPS;
    let m0 = 0.1 * 0.5;
    let m1 = 0.1 * 0.5 / 4.0f32.powf(1.5);
    assert!((st.shared[0] - m0).abs() < 1e-7 && (st.shared[1] - m1).abs() < 1e-7, "m {:?}", &st.shared[..2]);
    assert!((st.shared[2] - v).abs() < 1e-9 && (st.shared[3] - v).abs() < 1e-9, "v {:?}", &st.shared[2..]);
    assert!((st.params[0] - (1.0 - 0.01 * m0 / denom)).abs() < 1e-6, "θ0 {}", st.params[0]);
    assert!((st.params[1] - (1.0 - 0.01 * m1 / denom)).abs() < 1e-6, "θ1 {}", st.params[1]);
}

/// A prepared row update ends bit for bit where [`apply`] ends on the same block, for every rule and for
/// rows of 16 floats (the straight-line path), of 7 and of 33 (the general loop, with a tail), and it refuses
/// a block whose planes do not match as `apply` does.
#[test]
fn a_prepared_row_update_ends_where_apply_ends_for_every_rule() {
    let h = hyper();
    let s = PushScalars { lr: 0.05, lr_max: 0.08, staleness: 2, t: 3, workers: 3 };
    for (r, rule) in Rule::ALL.into_iter().enumerate() {
        let update = RowUpdate::new(rule, &h, &s);
        for n in [16, 7, 33] {
            let mut row = random_state(rule, n, 70 * r as u64 + n as u64);
            let mut block = row.clone();
            for step in 0..3u64 {
                let grad = random(n, 900 + step, -1.0, 1.0);
                let read: Vec<f32> = if rule.layout().needs_read { random(n, 950 + step, -1.0, 1.0) } else { vec![] };
                let bufs = Bufs::from_planes(&mut row.params, &mut row.shared, &mut row.worker, &grad, &read);
                update.apply(bufs).expect("row update");
                let bufs = Bufs::from_planes(&mut block.params, &mut block.shared, &mut block.worker, &grad, &read);
                apply(rule, &h, &s, bufs).expect("apply");
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&row.params), bits(&block.params), "{rule} n={n}: params");
            assert_eq!(bits(&row.shared), bits(&block.shared), "{rule} n={n}: shared planes");
            assert_eq!(bits(&row.worker), bits(&block.worker), "{rule} n={n}: worker planes");
            assert_ne!(row.params, random_state(rule, n, 70 * r as u64 + n as u64).params, "{rule}: it moved");
        }
        let mut short = random_state(rule, 16, 1);
        let grad = random(15, 2, -1.0, 1.0);
        let bufs = Bufs::from_planes(&mut short.params, &mut short.shared, &mut short.worker, &grad, &[]);
        assert!(update.apply(bufs).is_err(), "{rule}: a gradient of 15 for 16 parameters");
    }
}
