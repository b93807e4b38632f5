//! The fast CPU path: one straight loop per rule over slices re-bounded to `n`, so the compiler removes the
//! bounds checks and vectorises (no FMA contraction: results stay bit-comparable with the reference order of
//! operations). Every loop reads and writes each plane exactly once.

use crate::{Bufs, Derived, Rule, ADAM_BETA1, ADAM_BETA2, ADA_EPS, DC_EPS, GA_BETA, GA_EPS};

pub(crate) fn apply(rule: Rule, k: &Derived, n: usize, b: Bufs<'_>) {
    let p = &mut b.params[..n];
    let g = &b.grad[..n];
    let (lr, gamma, wd) = (k.lr, k.gamma, k.wd);
    match rule {
        Rule::Sgd => {
            for i in 0..n {
                let d = g[i] + wd * p[i];
                p[i] -= lr * d;
            }
        }
        Rule::DanaSlim => {
            for i in 0..n {
                p[i] -= lr * g[i];
            }
        }
        Rule::Momentum => {
            let v = &mut b.s0[..n];
            for i in 0..n {
                let d = g[i] + wd * p[i];
                v[i] = gamma * v[i] + d;
                p[i] -= lr * v[i];
            }
        }
        Rule::StalenessAware => {
            let v = &mut b.s0[..n];
            let scale = k.inv_staleness;
            for i in 0..n {
                let d = (g[i] + wd * p[i]) * scale;
                v[i] = gamma * v[i] + d;
                p[i] -= lr * v[i];
            }
        }
        Rule::Nesterov => {
            let v = &mut b.s0[..n];
            for i in 0..n {
                let d = g[i] + wd * p[i];
                v[i] = gamma * v[i] + d;
                p[i] -= lr * (d + gamma * v[i]);
            }
        }
        Rule::MultiMomentum => {
            let w = &mut b.w0[..n];
            for i in 0..n {
                let d = g[i] + wd * p[i];
                w[i] = gamma * w[i] + d;
                p[i] -= lr * w[i];
            }
        }
        Rule::DcAsgd => {
            let (v, r) = (&mut b.s0[..n], &b.read[..n]);
            let lambda = k.lambda;
            for i in 0..n {
                let gi = g[i];
                let d = gi + lambda * gi * gi * (p[i] - r[i]) + wd * p[i];
                v[i] = gamma * v[i] + d;
                p[i] -= lr * v[i];
            }
        }
        Rule::DcAsgdAdaptive => {
            let (v, ms, r) = (&mut b.s0[..n], &mut b.w0[..n], &b.read[..n]);
            let (lambda0, m) = (k.lambda, k.ms_decay);
            for i in 0..n {
                let gi = g[i];
                ms[i] = m * ms[i] + (1.0 - m) * gi * gi;
                let lambda = lambda0 / (ms[i] + DC_EPS).sqrt();
                let d = gi + lambda * gi * gi * (p[i] - r[i]) + wd * p[i];
                v[i] = gamma * v[i] + d;
                p[i] -= lr * v[i];
            }
        }
        Rule::GapAware => {
            let (v, ema, r) = (&mut b.s0[..n], &mut b.s1[..n], &b.read[..n]);
            let (bias, lr_max) = (k.ga_bias, k.lr_max);
            let with_momentum = gamma > 0.0;
            for i in 0..n {
                // The EMA tracks the previous step's direction: the momentum buffer before this update,
                // or the incoming gradient when there is no momentum.
                let s = if with_momentum { v[i] } else { g[i] };
                ema[i] = GA_BETA * ema[i] + (1.0 - GA_BETA) * s * s;
                let c = lr_max * ((ema[i] * bias).sqrt() + GA_EPS);
                let penalty = 1.0 + (p[i] - r[i]).abs() / c;
                let d = (g[i] + wd * p[i]) / penalty;
                v[i] = gamma * v[i] + d;
                p[i] -= lr * v[i];
            }
        }
        Rule::DanaZero => {
            let (sum, w) = (&mut b.s0[..n], &mut b.w0[..n]);
            for i in 0..n {
                let d = g[i] + wd * p[i];
                let new = gamma * w[i] + d;
                sum[i] += new - w[i];
                w[i] = new;
                p[i] -= lr * new;
            }
        }
        Rule::DanaDc => {
            let (sum, w, r) = (&mut b.s0[..n], &mut b.w0[..n], &b.read[..n]);
            let lambda = k.lambda;
            for i in 0..n {
                let gi = g[i];
                let d = gi + lambda * gi * gi * (p[i] - r[i]) + wd * p[i];
                let new = gamma * w[i] + d;
                sum[i] += new - w[i];
                w[i] = new;
                p[i] -= lr * new;
            }
        }
        Rule::DanaGa => {
            let (sum, ema, w, r) = (&mut b.s0[..n], &mut b.s1[..n], &mut b.w0[..n], &b.read[..n]);
            let (bias, lr_max) = (k.ga_bias, k.lr_max);
            for i in 0..n {
                ema[i] = GA_BETA * ema[i] + (1.0 - GA_BETA) * w[i] * w[i];
                let c = lr_max * ((ema[i] * bias).sqrt() + GA_EPS);
                let penalty = 1.0 + (p[i] - r[i]).abs() / c;
                let d = (g[i] + wd * p[i]) / penalty;
                let new = gamma * w[i] + d;
                sum[i] += new - w[i];
                w[i] = new;
                p[i] -= lr * new;
            }
        }
        Rule::Adagrad => {
            let acc = &mut b.s0[..n];
            for i in 0..n {
                let d = g[i] + wd * p[i];
                acc[i] += d * d;
                p[i] -= lr * d / (acc[i].sqrt() + ADA_EPS);
            }
        }
        Rule::Adam => {
            let (m, v) = (&mut b.s0[..n], &mut b.s1[..n]);
            let (b1, b2) = (k.adam_bias1, k.adam_bias2);
            for i in 0..n {
                let d = g[i] + wd * p[i];
                m[i] = ADAM_BETA1 * m[i] + (1.0 - ADAM_BETA1) * d;
                v[i] = ADAM_BETA2 * v[i] + (1.0 - ADAM_BETA2) * d * d;
                p[i] -= lr * (m[i] * b1) / ((v[i] * b2).sqrt() + ADA_EPS);
            }
        }
    }
}
