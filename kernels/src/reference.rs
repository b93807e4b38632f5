//! Plain scalar reference implementations: the oracle the fast CPU path and the CUDA kernels are tested
//! against. One parameter at a time, each rule written out from docs/ALGORITHMS.md, its per-push constants
//! computed here independently (f64 powers for the bias corrections).

use crate::{
    Hyper, PushScalars, Rule, ADAM_BETA1, ADAM_BETA2, ADA_EPS, DC_EPS, GA_BETA, GA_EPS, NADAM_BETA2, NADAM_PSI,
    NAG_GAMMA_MAX,
};

/// Planar state of one block for the reference: `shared` holds `shared_planes × n`, `worker` holds
/// `worker_planes × n` floats.
#[derive(Debug, Clone, PartialEq)]
pub struct State {
    /// θ.
    pub params: Vec<f32>,
    /// Shared planes, plane k at `[k·n, (k+1)·n)`.
    pub shared: Vec<f32>,
    /// The pushing worker's planes.
    pub worker: Vec<f32>,
}

/// Applies `rule` parameter by parameter.
pub fn apply(rule: Rule, hyper: &Hyper, s: &PushScalars, state: &mut State, grad: &[f32], read: &[f32]) {
    let n = state.params.len();
    let t = s.t.max(1) as f64;
    let ga_bias = (1.0 / (1.0 - f64::from(GA_BETA).powf(t))) as f32;
    let adam_b1 = (1.0 / (1.0 - f64::from(ADAM_BETA1).powf(t))) as f32;
    let adam_b2 = (1.0 / (1.0 - f64::from(ADAM_BETA2).powf(t))) as f32;
    // NAdam's schedule, written out here independently of `nadam_schedule`: the product over every step
    // (no early stop), μ_t and μ_{t+1}.
    let beta1 = f64::from(hyper.momentum);
    let mu = |k: f64| beta1 * (1.0 - 0.5 * 0.96f64.powf(k * NADAM_PSI));
    let mu_product: f64 = (1..=s.t.clamp(1, 100_000)).map(|k| mu(k as f64)).product();
    let (mu_t, mu_next) = (mu(t), mu(t + 1.0));
    let nadam_g = (f64::from(s.lr) * (1.0 - mu_t) / (1.0 - mu_product)) as f32;
    let nadam_m = (f64::from(s.lr) * mu_next / (1.0 - mu_product * mu_next)) as f32;
    let nadam_b2 = (1.0 / (1.0 - f64::from(NADAM_BETA2).powf(t))) as f32;
    let lr = s.lr;
    let lr_max = s.lr_max.max(s.lr);
    let gamma = hyper.momentum;
    let wd = hyper.weight_decay;
    let lambda = hyper.dc_lambda;
    for i in 0..n {
        let p = state.params[i];
        let g = grad[i];
        let drift = if rule.layout().needs_read { p - read[i] } else { 0.0 };
        // Gap-Aware penalty G = 1 + |Δ| / C with C = η_max (√v̂ + ε); `ema` is updated by the caller first.
        let gap_penalty = |ema: f32| 1.0 + drift.abs() / (lr_max * ((ema * ga_bias).sqrt() + GA_EPS));
        match rule {
            Rule::Sgd => state.params[i] = p - lr * (g + wd * p),
            Rule::DanaSlim => state.params[i] = p - lr * g,
            Rule::Momentum | Rule::StalenessAware | Rule::Nesterov => {
                let scale = if rule == Rule::StalenessAware { 1.0 / s.staleness.max(1) as f32 } else { 1.0 };
                let d = (g + wd * p) * scale;
                let v = gamma * state.shared[i] + d;
                state.shared[i] = v;
                state.params[i] = if rule == Rule::Nesterov { p - lr * (d + gamma * v) } else { p - lr * v };
            }
            Rule::DelayNesterov => {
                // γ_τ from the delay, written out here independently of `delay_momentum`.
                let n_workers = s.workers.max(1) as f32;
                let top = if gamma > NAG_GAMMA_MAX { gamma } else { NAG_GAMMA_MAX };
                let g_tau = gamma + (top - gamma) * (s.staleness as f32).min(n_workers) / n_workers;
                let d = g + wd * p;
                let m = g_tau * state.shared[i] + (1.0 - g_tau) * d;
                state.shared[i] = m;
                state.params[i] = p - lr / (1.0 - gamma) * m;
            }
            Rule::MultiMomentum => {
                let v = gamma * state.worker[i] + (g + wd * p);
                state.worker[i] = v;
                state.params[i] = p - lr * v;
            }
            Rule::DcAsgd | Rule::DcAsgdAdaptive => {
                let lam = if rule == Rule::DcAsgdAdaptive {
                    let ms = hyper.dc_ms_decay * state.worker[i] + (1.0 - hyper.dc_ms_decay) * g * g;
                    state.worker[i] = ms;
                    lambda / (ms + DC_EPS).sqrt()
                } else {
                    lambda
                };
                let compensated = g + lam * g * g * drift;
                let v = gamma * state.shared[i] + (compensated + wd * p);
                state.shared[i] = v;
                state.params[i] = p - lr * v;
            }
            Rule::GapAware => {
                let previous = if gamma > 0.0 { state.shared[i] } else { g };
                let ema = GA_BETA * state.shared[n + i] + (1.0 - GA_BETA) * previous * previous;
                state.shared[n + i] = ema;
                let d = (g + wd * p) / gap_penalty(ema);
                let v = gamma * state.shared[i] + d;
                state.shared[i] = v;
                state.params[i] = p - lr * v;
            }
            Rule::DanaZero | Rule::DanaDc | Rule::DanaGa => {
                let old = state.worker[i];
                let d = match rule {
                    Rule::DanaDc => g + lambda * g * g * drift + wd * p,
                    Rule::DanaGa => {
                        let ema = GA_BETA * state.shared[n + i] + (1.0 - GA_BETA) * old * old;
                        state.shared[n + i] = ema;
                        (g + wd * p) / gap_penalty(ema)
                    }
                    _ => g + wd * p,
                };
                let new = gamma * old + d;
                state.shared[i] += new - old;
                state.worker[i] = new;
                state.params[i] = p - lr * new;
            }
            Rule::Adagrad => {
                let d = g + wd * p;
                let acc = state.shared[i] + d * d;
                state.shared[i] = acc;
                state.params[i] = p - lr * d / (acc.sqrt() + ADA_EPS);
            }
            Rule::Adam => {
                let d = g + wd * p;
                let m = ADAM_BETA1 * state.shared[i] + (1.0 - ADAM_BETA1) * d;
                let v = ADAM_BETA2 * state.shared[n + i] + (1.0 - ADAM_BETA2) * d * d;
                state.shared[i] = m;
                state.shared[n + i] = v;
                state.params[i] = p - lr * (m * adam_b1) / ((v * adam_b2).sqrt() + ADA_EPS);
            }
            Rule::Nadam => {
                let m = gamma * state.shared[i] + (1.0 - gamma) * g;
                let v = NADAM_BETA2 * state.shared[n + i] + (1.0 - NADAM_BETA2) * g * g;
                state.shared[i] = m;
                state.shared[n + i] = v;
                let denom = (v * nadam_b2).sqrt() + ADA_EPS;
                let decayed = p * (1.0 - lr * wd);
                state.params[i] = decayed - nadam_g * g / denom - nadam_m * m / denom;
            }
            Rule::GapAdam => {
                let d = g + wd * p;
                let v = ADAM_BETA2 * state.shared[n + i] + (1.0 - ADAM_BETA2) * d * d;
                state.shared[n + i] = v;
                let base = 1.0 + drift.abs() / lr_max;
                let penalty = base * base.sqrt();
                let m = gamma * state.shared[i] + (1.0 - gamma) * (d / penalty);
                state.shared[i] = m;
                state.params[i] = p - lr * m / ((v * adam_b2).sqrt() + ADA_EPS);
            }
        }
    }
}
