//! The fast CPU path: one straight loop per rule over slices re-bounded to `n`, so the compiler removes the
//! bounds checks and vectorises (no FMA contraction: results stay bit-comparable with the reference order of
//! operations). Every loop reads and writes each plane exactly once.

use crate::{Bufs, Derived, Rule, ADAM_BETA1, ADAM_BETA2, ADA_EPS, DC_EPS, GA_BETA, GA_EPS};

/// Runs the loops compiled for AVX2 (8 lanes) when the CPU has it, else the baseline build (SSE2's 4);
/// AVX-512 (16 lanes) when `GAPS_KERNEL_ISA=avx512` asks for it (see [`isa`]). Same operations either
/// way: no FMA is enabled, so the results are identical.
pub(crate) fn apply(rule: Rule, k: &Derived, n: usize, b: Bufs<'_>) {
    apply_with(isa(), rule, k, n, b)
}

/// [`apply`] with the instruction set `which`, which must not be wider than [`detected`].
pub(crate) fn apply_with(which: Isa, rule: Rule, k: &Derived, n: usize, b: Bufs<'_>) {
    #[cfg(target_arch = "x86_64")]
    match which.min(detected()) {
        #[allow(unsafe_code)]
        // SAFETY: `apply_avx512` only requires AVX-512F, whose presence `isa` checked at run time.
        Isa::Avx512 => unsafe { apply_avx512(rule, k, n, b) },
        #[allow(unsafe_code)]
        // SAFETY: `apply_avx2` only requires AVX2, whose presence `isa` checked at run time.
        Isa::Avx2 => unsafe { apply_avx2(rule, k, n, b) },
        Isa::Baseline => apply_loops(rule, k, n, b),
    }
    #[cfg(not(target_arch = "x86_64"))]
    apply_loops(rule, k, n, b)
}

/// The vector instruction set the loops run with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// The build's baseline (SSE2 on x86-64).
    Baseline,
    /// AVX2, 8 lanes.
    Avx2,
    /// AVX-512F, 16 lanes.
    Avx512,
}

/// The widest instruction set the CPU has.
pub fn detected() -> Isa {
    static BEST: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *BEST.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Isa::Avx512;
        } else if std::arch::is_x86_feature_detected!("avx2") {
            return Isa::Avx2;
        }
        Isa::Baseline
    })
}

/// The instruction set the loops use: AVX2 where the CPU has it, or the one `GAPS_KERNEL_ISA` names
/// (`baseline`, `avx2`, `avx512`; one the CPU lacks is not used). AVX-512 is not the default: measured on
/// the development machine (2 cores, 16 and 64 Mi parameters, `gaps bench kernels`, alternating runs) it
/// ran the rules at the same parameters per second as AVX2 (the heavy ones within ±3 %, the light ones up
/// to 8 % faster, within the runs' spread), and 16-lane code lowers the clock on some Intel parts.
pub fn isa() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        let asked = match std::env::var("GAPS_KERNEL_ISA").as_deref() {
            Ok("baseline") => Isa::Baseline,
            Ok("avx512") => Isa::Avx512,
            _ => Isa::Avx2,
        };
        detected().min(asked)
    })
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2")]
unsafe fn apply_avx2(rule: Rule, k: &Derived, n: usize, b: Bufs<'_>) {
    apply_loops(rule, k, n, b)
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f")]
unsafe fn apply_avx512(rule: Rule, k: &Derived, n: usize, b: Bufs<'_>) {
    apply_loops(rule, k, n, b)
}

/// Gap-Aware's loop, with the choice of the EMA's input (momentum buffer or raw gradient) made once.
#[inline(always)]
fn gap_aware<const MOMENTUM: bool>(
    k: &Derived,
    n: usize,
    p: &mut [f32],
    g: &[f32],
    v: &mut [f32],
    ema: &mut [f32],
    r: &[f32],
) {
    let (p, g, v, ema, r) = (&mut p[..n], &g[..n], &mut v[..n], &mut ema[..n], &r[..n]);
    let (lr, gamma, wd, bias, lr_max) = (k.lr, k.gamma, k.wd, k.ga_bias, k.lr_max);
    for i in 0..n {
        // The EMA tracks the previous step's direction: the momentum buffer before this update, or the
        // incoming gradient when there is no momentum.
        let s = if MOMENTUM { v[i] } else { g[i] };
        ema[i] = GA_BETA * ema[i] + (1.0 - GA_BETA) * s * s;
        let c = lr_max * ((ema[i] * bias).sqrt() + GA_EPS);
        let penalty = 1.0 + (p[i] - r[i]).abs() / c;
        let d = (g[i] + wd * p[i]) / penalty;
        v[i] = gamma * v[i] + d;
        p[i] -= lr * v[i];
    }
}

#[inline(always)]
fn apply_loops(rule: Rule, k: &Derived, n: usize, b: Bufs<'_>) {
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
        Rule::DelayNesterov => {
            let m = &mut b.s0[..n];
            let (gt, keep, step) = (k.nag_gamma, k.nag_keep, k.nag_lr);
            for i in 0..n {
                let d = g[i] + wd * p[i];
                m[i] = gt * m[i] + keep * d;
                p[i] -= step * m[i];
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
            if gamma > 0.0 {
                gap_aware::<true>(k, n, p, g, b.s0, b.s1, b.read);
            } else {
                gap_aware::<false>(k, n, p, g, b.s0, b.s1, b.read);
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

/// The streaming yardstick (see `crate::stream_baseline`), dispatched like [`apply`] so the baseline gets
/// the same vector width as the rules it is compared with.
pub(crate) fn stream(b: Bufs<'_>) {
    #[cfg(target_arch = "x86_64")]
    match isa() {
        #[allow(unsafe_code)]
        // SAFETY: `stream_avx512` only requires AVX-512F, whose presence `isa` checked at run time.
        Isa::Avx512 => unsafe { stream_avx512(b) },
        #[allow(unsafe_code)]
        // SAFETY: `stream_avx2` only requires AVX2, whose presence `isa` checked at run time.
        Isa::Avx2 => unsafe { stream_avx2(b) },
        Isa::Baseline => stream_loops(b),
    }
    #[cfg(not(target_arch = "x86_64"))]
    stream_loops(b)
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2")]
unsafe fn stream_avx2(b: Bufs<'_>) {
    stream_loops(b)
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f")]
unsafe fn stream_avx512(b: Bufs<'_>) {
    stream_loops(b)
}

/// One fused pass: x = g (+ read); every present plane += x. Each shape has its own loop over named,
/// re-bounded slices so the compiler vectorises it exactly like the rules.
#[inline(always)]
fn stream_loops(b: Bufs<'_>) {
    let n = b.params.len();
    let g = &b.grad[..n];
    let r = b.read;
    let p = &mut b.params[..n];
    let (s0, s1, w0) = (b.s0, b.s1, b.w0);
    macro_rules! pass {
        ($($plane:ident),*) => {{
            $(let $plane = &mut $plane[..n];)*
            if r.is_empty() {
                for i in 0..n {
                    let x = g[i];
                    p[i] += x;
                    $($plane[i] += x;)*
                }
            } else {
                let r = &r[..n];
                for i in 0..n {
                    let x = g[i] + r[i];
                    p[i] += x;
                    $($plane[i] += x;)*
                }
            }
        }};
    }
    match (s0.is_empty(), s1.is_empty(), w0.is_empty()) {
        (true, _, true) => pass!(),
        (true, _, false) => pass!(w0),
        (false, true, true) => pass!(s0),
        (false, true, false) => pass!(s0, w0),
        (false, false, true) => pass!(s0, s1),
        (false, false, false) => pass!(s0, s1, w0),
    }
}
