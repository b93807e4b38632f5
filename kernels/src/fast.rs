//! The fast CPU path: one straight loop per rule over slices re-bounded to `n`, so the compiler removes the
//! bounds checks and vectorises (no FMA contraction: results stay bit-comparable with the reference order of
//! operations). Every loop reads and writes each plane exactly once.

use crate::{Bufs, Derived, Rule, ADAM_BETA1, ADAM_BETA2, ADA_EPS, DC_EPS, GA_BETA, GA_EPS, NADAM_BETA2};

/// Runs the loops compiled for the widest vector set the CPU has (see [`isa`]): AVX-512 (16 lanes), AVX2
/// (8) or the baseline build (SSE2's 4). Same operations either way: no FMA is enabled, so the results are
/// identical.
pub(crate) fn apply(rule: Rule, k: &Derived, n: usize, b: Bufs<'_>) {
    apply_with(isa(), rule, k, n, b)
}

/// [`apply_with`] for one short block (a table row): a block of 16 floats, the common embedding width, runs
/// as straight-line vector code (its length known to the compiler) rather than the general loop's tail.
#[inline]
pub(crate) fn apply_row(which: Isa, rule: Rule, k: &Derived, n: usize, b: Bufs<'_>) {
    #[cfg(target_arch = "x86_64")]
    match which.min(detected()) {
        #[allow(unsafe_code)]
        // SAFETY: `row_avx512` only requires AVX-512F, whose presence `detected` checked at run time.
        Isa::Avx512 => unsafe { row_avx512(rule, k, n, b) },
        #[allow(unsafe_code)]
        // SAFETY: `row_avx2` only requires AVX2, whose presence `detected` checked at run time.
        Isa::Avx2 => unsafe { row_avx2(rule, k, n, b) },
        Isa::Baseline => row_loops(rule, k, n, b),
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = which;
        row_loops(rule, k, n, b)
    }
}

/// A row of [`ROW`] floats goes through local copies of its planes: the compiler then knows they do not
/// alias one another (slices out of a struct may, see [`apply_loops`]) and keeps each plane in one vector
/// register; a loop of 16 over the slices themselves unrolls into scalar code.
#[inline(always)]
fn row_loops(rule: Rule, k: &Derived, n: usize, b: Bufs<'_>) {
    if n != ROW {
        return apply_loops(rule, k, n, b);
    }
    let load = |from: &[f32]| -> [f32; ROW] {
        let mut to = [0.0; ROW];
        if from.len() == ROW {
            to.copy_from_slice(from);
        }
        to
    };
    let (mut p, mut s0, mut s1, mut w0) = (load(b.params), load(b.s0), load(b.s1), load(b.w0));
    let (g, r) = (load(b.grad), load(b.read));
    fn cut(plane: &mut [f32; ROW], len: usize) -> &mut [f32] {
        &mut plane[..len.min(ROW)]
    }
    let local = Bufs {
        params: &mut p,
        s0: cut(&mut s0, b.s0.len()),
        s1: cut(&mut s1, b.s1.len()),
        w0: cut(&mut w0, b.w0.len()),
        grad: &g,
        read: &r[..b.read.len().min(ROW)],
    };
    apply_loops(rule, k, ROW, local);
    b.params.copy_from_slice(&p);
    for (to, from) in [(b.s0, &s0), (b.s1, &s1), (b.w0, &w0)] {
        if to.len() == ROW {
            to.copy_from_slice(from);
        }
    }
}

/// The row width [`row_loops`] runs as straight-line vector code.
const ROW: usize = 16;

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2")]
unsafe fn row_avx2(rule: Rule, k: &Derived, n: usize, b: Bufs<'_>) {
    row_loops(rule, k, n, b)
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f")]
unsafe fn row_avx512(rule: Rule, k: &Derived, n: usize, b: Bufs<'_>) {
    row_loops(rule, k, n, b)
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

/// The instruction set the loops use: the widest the CPU has, or the one `GAPS_KERNEL_ISA` names
/// (`baseline`, `avx2`, `avx512`; one the CPU lacks is not used). AVX-512 is the default since the
/// 2026-11-25 measurement on an AMD EPYC (Zen 4, 2 cores, `gaps bench kernels` at 16 and 64 Mi): every rule
/// at 0.91–1.08 of the streaming loop with 16 lanes, against 0.79–0.89 for gap-aware, dc-asgd-adaptive
/// and Adagrad with AVX2; on the Intel Xeon measured before, the two widths ran at the same speed (±3 %).
/// On Intel parts that lower their clock for 512-bit arithmetic (Skylake-SP, Cascade Lake)
/// `GAPS_KERNEL_ISA=avx2` keeps the shard's other threads at full clock.
pub fn isa() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        let asked = match std::env::var("GAPS_KERNEL_ISA").as_deref() {
            Ok("baseline") => Isa::Baseline,
            Ok("avx2") => Isa::Avx2,
            _ => Isa::Avx512,
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
        let (pi, vi) = (p[i], v[i]);
        // The EMA tracks the previous step's direction: the momentum buffer before this update, or the
        // incoming gradient when there is no momentum.
        let s = if MOMENTUM { vi } else { g[i] };
        let e = GA_BETA * ema[i] + (1.0 - GA_BETA) * s * s;
        ema[i] = e;
        let c = lr_max * ((e * bias).sqrt() + GA_EPS);
        let penalty = 1.0 + (pi - r[i]).abs() / c;
        let d = (g[i] + wd * pi) / penalty;
        let vi = gamma * vi + d;
        v[i] = vi;
        p[i] = pi - lr * vi;
    }
}

/// Every rule's loop. Each element's planes are read into locals once and each written once: the
/// slices come out of a struct, so the compiler cannot prove they do not alias one another, and a value
/// read back after a store to another plane is reloaded from memory. With 64-byte vectors on 16-byte
/// aligned buffers such a reload spans two cache lines and cannot be forwarded from the store: measured on
/// an AMD EPYC (Zen 4), Adam at 64 Mi stalled there and ran at 0.80 of the streaming loop, 1.02 without.
#[inline(always)]
fn apply_loops(rule: Rule, k: &Derived, n: usize, b: Bufs<'_>) {
    let p = &mut b.params[..n];
    let g = &b.grad[..n];
    let (lr, gamma, wd) = (k.lr, k.gamma, k.wd);
    match rule {
        Rule::Sgd => {
            for i in 0..n {
                let pi = p[i];
                let d = g[i] + wd * pi;
                p[i] = pi - lr * d;
            }
        }
        Rule::DanaSlim => {
            for i in 0..n {
                p[i] -= lr * g[i];
            }
        }
        // Heavy-ball momentum: the multi-momentum rule keeps its buffer per worker, the staleness-aware one
        // scales the gradient by 1/staleness (the others by 1, which changes no bit).
        Rule::Momentum | Rule::StalenessAware | Rule::MultiMomentum => {
            let v = if rule == Rule::MultiMomentum { &mut b.w0[..n] } else { &mut b.s0[..n] };
            let scale = if rule == Rule::StalenessAware { k.inv_staleness } else { 1.0 };
            for i in 0..n {
                let pi = p[i];
                let d = (g[i] + wd * pi) * scale;
                let vi = gamma * v[i] + d;
                v[i] = vi;
                p[i] = pi - lr * vi;
            }
        }
        Rule::Nesterov => {
            let v = &mut b.s0[..n];
            for i in 0..n {
                let pi = p[i];
                let d = g[i] + wd * pi;
                let vi = gamma * v[i] + d;
                v[i] = vi;
                p[i] = pi - lr * (d + gamma * vi);
            }
        }
        Rule::DelayNesterov => {
            let m = &mut b.s0[..n];
            let (gt, keep, step) = (k.nag_gamma, k.nag_keep, k.nag_lr);
            for i in 0..n {
                let pi = p[i];
                let d = g[i] + wd * pi;
                let mi = gt * m[i] + keep * d;
                m[i] = mi;
                p[i] = pi - step * mi;
            }
        }
        Rule::DcAsgd => {
            let (v, r) = (&mut b.s0[..n], &b.read[..n]);
            let lambda = k.lambda;
            for i in 0..n {
                let (pi, gi) = (p[i], g[i]);
                let d = gi + lambda * gi * gi * (pi - r[i]) + wd * pi;
                let vi = gamma * v[i] + d;
                v[i] = vi;
                p[i] = pi - lr * vi;
            }
        }
        Rule::DcAsgdAdaptive => {
            let (v, ms, r) = (&mut b.s0[..n], &mut b.w0[..n], &b.read[..n]);
            let (lambda0, m) = (k.lambda, k.ms_decay);
            for i in 0..n {
                let (pi, gi) = (p[i], g[i]);
                let msi = m * ms[i] + (1.0 - m) * gi * gi;
                ms[i] = msi;
                let lambda = lambda0 / (msi + DC_EPS).sqrt();
                let d = gi + lambda * gi * gi * (pi - r[i]) + wd * pi;
                let vi = gamma * v[i] + d;
                v[i] = vi;
                p[i] = pi - lr * vi;
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
                let (pi, wi) = (p[i], w[i]);
                let d = g[i] + wd * pi;
                let new = gamma * wi + d;
                sum[i] += new - wi;
                w[i] = new;
                p[i] = pi - lr * new;
            }
        }
        Rule::DanaDc => {
            let (sum, w, r) = (&mut b.s0[..n], &mut b.w0[..n], &b.read[..n]);
            let lambda = k.lambda;
            for i in 0..n {
                let (pi, gi, wi) = (p[i], g[i], w[i]);
                let d = gi + lambda * gi * gi * (pi - r[i]) + wd * pi;
                let new = gamma * wi + d;
                sum[i] += new - wi;
                w[i] = new;
                p[i] = pi - lr * new;
            }
        }
        Rule::DanaGa => {
            let (sum, ema, w, r) = (&mut b.s0[..n], &mut b.s1[..n], &mut b.w0[..n], &b.read[..n]);
            let (bias, lr_max) = (k.ga_bias, k.lr_max);
            for i in 0..n {
                let (pi, wi) = (p[i], w[i]);
                let e = GA_BETA * ema[i] + (1.0 - GA_BETA) * wi * wi;
                ema[i] = e;
                let c = lr_max * ((e * bias).sqrt() + GA_EPS);
                let penalty = 1.0 + (pi - r[i]).abs() / c;
                let d = (g[i] + wd * pi) / penalty;
                let new = gamma * wi + d;
                sum[i] += new - wi;
                w[i] = new;
                p[i] = pi - lr * new;
            }
        }
        Rule::Adagrad => {
            let acc = &mut b.s0[..n];
            for i in 0..n {
                let pi = p[i];
                let d = g[i] + wd * pi;
                let a = acc[i] + d * d;
                acc[i] = a;
                p[i] = pi - lr * d / (a.sqrt() + ADA_EPS);
            }
        }
        Rule::Adam => {
            let (m, v) = (&mut b.s0[..n], &mut b.s1[..n]);
            let (b1, b2) = (k.adam_bias1, k.adam_bias2);
            for i in 0..n {
                let pi = p[i];
                let d = g[i] + wd * pi;
                let mi = ADAM_BETA1 * m[i] + (1.0 - ADAM_BETA1) * d;
                let vi = ADAM_BETA2 * v[i] + (1.0 - ADAM_BETA2) * d * d;
                m[i] = mi;
                v[i] = vi;
                p[i] = pi - lr * (mi * b1) / ((vi * b2).sqrt() + ADA_EPS);
            }
        }
        Rule::Nadam => {
            let (m, v) = (&mut b.s0[..n], &mut b.s1[..n]);
            let (b2, cg, cm, decay) = (k.adam_bias2, k.nadam_grad, k.nadam_mom, k.decay);
            for i in 0..n {
                let (pi, gi) = (p[i], g[i]);
                let mi = gamma * m[i] + (1.0 - gamma) * gi;
                let vi = NADAM_BETA2 * v[i] + (1.0 - NADAM_BETA2) * gi * gi;
                m[i] = mi;
                v[i] = vi;
                let denom = (vi * b2).sqrt() + ADA_EPS;
                p[i] = pi * decay - cg * gi / denom - cm * mi / denom;
            }
        }
        Rule::GapAdam => {
            let (m, v, r) = (&mut b.s0[..n], &mut b.s1[..n], &b.read[..n]);
            let (b2, lr_max) = (k.adam_bias2, k.lr_max);
            for i in 0..n {
                let pi = p[i];
                let d = g[i] + wd * pi;
                let vi = ADAM_BETA2 * v[i] + (1.0 - ADAM_BETA2) * d * d;
                v[i] = vi;
                let base = 1.0 + (pi - r[i]).abs() / lr_max;
                let penalty = base * base.sqrt();
                let mi = gamma * m[i] + (1.0 - gamma) * (d / penalty);
                m[i] = mi;
                p[i] = pi - lr * mi / ((vi * b2).sqrt() + ADA_EPS);
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
