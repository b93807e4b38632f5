//! gaps-kernels: the update rules a shard applies to its parameters.
//!
//! Every rule is a pure elementwise function of (hyper-parameters, per-push scalars, parameters, optimizer
//! state, gradient, and — for the rules that measure drift — the parameters the gradient was computed on).
//! Each rule documents its state layout as *planes* of `n` floats:
//!
//! - **shared planes** live with the parameters (one copy per parameter);
//! - **worker planes** are kept per pushing worker (they grow with the number of workers, only for the rules
//!   that need them: multi-momentum, DANA-Zero/DC/GA, DC-ASGD-adaptive);
//! - **read**: the parameters the gradient was computed on, echoed by the worker with its push (Gap-Aware,
//!   DC-ASGD, DANA-DC, DANA-GA), so the server never keeps a snapshot per worker.
//!
//! [`reference`] is the plain scalar implementation (the oracle); [`apply`] the fast path (straight-line
//! slice loops the compiler vectorises) and [`apply_par`] the same split over threads for large blocks.
//!
//! Architecture invariant: no I/O, no async runtime, no allocation on the update path.

use std::fmt;
use std::str::FromStr;

pub mod cuda;
pub mod plan;
pub mod reference;
pub mod resident;

/// EMA decay β of Gap-Aware's running mean of squared steps (docs/ALGORITHMS.md §3).
pub const GA_BETA: f32 = 0.999;
/// ε of Gap-Aware's C = η_max·(√v̂ + ε).
pub const GA_EPS: f32 = 1e-8;
/// ε of DC-ASGD-adaptive's λ = λ0/√(MS + ε).
pub const DC_EPS: f32 = 1e-7;
/// Adam β1.
pub const ADAM_BETA1: f32 = 0.9;
/// Adam β2.
pub const ADAM_BETA2: f32 = 0.999;
/// ε of Adam and Adagrad.
pub const ADA_EPS: f32 = 1e-8;
/// The momentum delay-nesterov reaches at a delay of N (the AsyncPP code's β1).
pub const NAG_GAMMA_MAX: f32 = 0.99;
/// NAdam's β2 (PyTorch's default, and the AsyncPP run's).
pub const NADAM_BETA2: f32 = 0.999;
/// NAdam's ψ (`momentum_decay`): the momentum schedule μ_t = β1·(1 − ½·0.96^(t·ψ)).
pub const NADAM_PSI: f64 = 0.004;

/// The update rules, selected by name with `--rule`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rule {
    /// θ ← θ − η·d with d = g + λθ.
    Sgd,
    /// Heavy ball (PyTorch form): v ← γv + d; θ ← θ − ηv.
    Momentum,
    /// Nesterov (Bengio/PyTorch form): v ← γv + d; θ ← θ − η(d + γv).
    Nesterov,
    /// Per-worker momentum at the server: v^i ← γv^i + d; θ ← θ − ηv^i.
    MultiMomentum,
    /// Staleness-aware: d scaled by 1/max(τ, 1), then momentum.
    StalenessAware,
    /// DC-ASGD, constant λ: g̃ = g + λ·g⊙g⊙(θ − θ_read); then momentum.
    DcAsgd,
    /// DC-ASGD adaptive: per-worker MS ← m·MS + (1−m)g²; λ = λ0/√(MS + ε); then as DC-ASGD.
    DcAsgdAdaptive,
    /// Gap-Aware: g divided by G = 1 + |θ − θ_read| / (η_max(√v̂ + ε)) before momentum (γ = 0: no momentum).
    GapAware,
    /// DANA-Zero: per-worker momenta, S = Σv^j; pulls return the look-ahead θ − ηγS.
    DanaZero,
    /// DANA-Slim: the worker keeps its momentum and pushes u = γv + g; the server does θ ← θ − ηu.
    DanaSlim,
    /// DANA-DC: DANA-Zero with the DC-ASGD term on θ − θ̂_i (λ constant).
    DanaDc,
    /// DANA-GA: DANA-Zero with the Gap-Aware penalty on θ − θ̂_i (EMA of the pushing worker's momentum).
    DanaGa,
    /// Adagrad: A ← A + d²; θ ← θ − η·d/(√A + ε).
    Adagrad,
    /// Adam (β1 0.9, β2 0.999, ε 1e-8, bias-corrected by the chunk's update count).
    Adam,
    /// Delay-adaptive Nesterov (our reading of Ajanthan et al., ICML 2025; docs/ALGORITHMS.md §8): the
    /// momentum grows with the gradient's delay, γ_τ = γ + (γ_max − γ)·min(τ, N)/N with γ_max = 0.99 and N
    /// the live workers, kept as an average m ← γ_τm + (1 − γ_τ)d so a longer memory does not enlarge the
    /// step; θ ← θ − η/(1−γ)·m; pulls return the look-ahead θ − η/(1−γ)·γN·m, the parameters extrapolated
    /// along the momentum over the expected delay. With one worker and no delay this is Nesterov.
    DelayNesterov,
    /// NAdam as the asynchronous pipeline-parallel Nesterov authors run it (PyTorch's NAdam, Dozat's
    /// Nesterov-Adam): m ← β1m + (1−β1)g, v ← β2v + (1−β2)g², θ ← θ(1 − ηλ) − η·[(1−μ_t)/(1−Πμ)·g +
    /// μ_{t+1}/(1−Πμ·μ_{t+1})·m]/(√(v/(1−β2^t)) + ε) with μ_t = β1(1 − ½·0.96^(tψ)), β1 = `momentum`
    /// (0.99 in their runs), β2 0.999, ψ 0.004, decoupled weight decay λ. Pulls return θ: the gradient is
    /// computed on the values the worker pulled (their weight stashing).
    Nadam,
    /// Gap-Adam (ours, docs/ALGORITHMS.md §4.2): Adam's per-parameter step with Gap-Aware's penalty measured
    /// in steps. v ← β2v + (1−β2)d² of the whole gradient d = g + λθ; G = (1 + |θ − θ_read|/η_max)^{3/2};
    /// m ← β1m + (1−β1)·d/G with β1 = `momentum`; θ ← θ − η·m/(√(v/(1−β2^t)) + ε). An Adam step moves a
    /// parameter by about η at most, so |θ − θ_read|/η_max counts the steps it moved since the worker read
    /// it; v sees the gradient unpenalised, so the normalisation does not undo the penalty.
    GapAdam,
}

/// Where a rule keeps its state and what a push must carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateLayout {
    /// Planes of `n` floats kept once per parameter, beside θ.
    pub shared_planes: usize,
    /// Planes of `n` floats kept per pushing worker.
    pub worker_planes: usize,
    /// The push carries the parameters the gradient was computed on (`read`).
    pub needs_read: bool,
    /// Pulls return the DANA look-ahead θ − ηγS (S is shared plane 0) instead of θ.
    pub lookahead: bool,
    /// The worker keeps one momentum plane and pushes a Nesterov step instead of its gradient (DANA-Slim).
    pub worker_momentum: bool,
}

impl Rule {
    /// Every rule, in documentation order.
    pub const ALL: [Rule; 17] = [
        Rule::Sgd,
        Rule::Momentum,
        Rule::Nesterov,
        Rule::MultiMomentum,
        Rule::StalenessAware,
        Rule::DcAsgd,
        Rule::DcAsgdAdaptive,
        Rule::GapAware,
        Rule::DanaZero,
        Rule::DanaSlim,
        Rule::DanaDc,
        Rule::DanaGa,
        Rule::Adagrad,
        Rule::Adam,
        Rule::DelayNesterov,
        Rule::Nadam,
        Rule::GapAdam,
    ];

    /// The name used by `--rule`.
    pub fn name(self) -> &'static str {
        match self {
            Rule::Sgd => "sgd",
            Rule::Momentum => "momentum",
            Rule::Nesterov => "nesterov",
            Rule::MultiMomentum => "multi-momentum",
            Rule::StalenessAware => "staleness-aware",
            Rule::DcAsgd => "dc-asgd",
            Rule::DcAsgdAdaptive => "dc-asgd-adaptive",
            Rule::GapAware => "gap-aware",
            Rule::DanaZero => "dana-zero",
            Rule::DanaSlim => "dana-slim",
            Rule::DanaDc => "dana-dc",
            Rule::DanaGa => "dana-ga",
            Rule::Adagrad => "adagrad",
            Rule::Adam => "adam",
            Rule::DelayNesterov => "delay-nesterov",
            Rule::Nadam => "nadam",
            Rule::GapAdam => "gap-adam",
        }
    }

    /// True when an update's constants depend on the row's own staleness or update count (the staleness
    /// scale, Nesterov's delay-adjusted momentum, Gap-Aware's and Adam's bias corrections): rows of one push
    /// are then updated one call each; for the other rules every row of a push shares the constants,
    /// derived once for all of them ([`RowUpdate`]).
    pub fn scalars_per_row(self) -> bool {
        matches!(
            self,
            Rule::StalenessAware
                | Rule::DelayNesterov
                | Rule::GapAware
                | Rule::DanaGa
                | Rule::Adam
                | Rule::Nadam
                | Rule::GapAdam
        )
    }

    /// The rule's state layout.
    pub fn layout(self) -> StateLayout {
        let l = |shared_planes, worker_planes, needs_read, lookahead| StateLayout {
            shared_planes,
            worker_planes,
            needs_read,
            lookahead,
            worker_momentum: false,
        };
        match self {
            Rule::Sgd => l(0, 0, false, false),
            Rule::Momentum | Rule::Nesterov | Rule::StalenessAware => l(1, 0, false, false),
            Rule::DelayNesterov => l(1, 0, false, true),
            Rule::MultiMomentum => l(0, 1, false, false),
            Rule::DcAsgd => l(1, 0, true, false),
            Rule::DcAsgdAdaptive => l(1, 1, true, false),
            Rule::GapAware => l(2, 0, true, false),
            Rule::DanaZero => l(1, 1, false, true),
            Rule::DanaSlim => StateLayout { worker_momentum: true, ..l(0, 0, false, false) },
            Rule::DanaDc => l(1, 1, true, true),
            Rule::DanaGa => l(2, 1, true, true),
            Rule::Adagrad => l(1, 0, false, false),
            Rule::Adam | Rule::Nadam => l(2, 0, false, false),
            Rule::GapAdam => l(2, 0, true, false),
        }
    }

    /// The rule divides its step by a running magnitude of the gradient (Adagrad, Adam, NAdam, Gap-Adam):
    /// its step has about the learning rate's size whatever the gradient's scale, so a fraction of a
    /// gradient does not make a fraction of a step.
    pub fn normalises_step(self) -> bool {
        matches!(self, Rule::Adagrad | Rule::Adam | Rule::Nadam | Rule::GapAdam)
    }

    /// Floats read and written per parameter by one update (θ, gradient, read echo, every state plane),
    /// i.e. the memory traffic the fast path cannot avoid.
    pub fn bytes_per_param(self) -> usize {
        let l = self.layout();
        let planes = l.shared_planes + l.worker_planes;
        // Read: θ, g, read echo, every plane. Written: θ, every plane.
        4 * ((2 + usize::from(l.needs_read) + planes) + (1 + planes))
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown rule name, an invalid hyper-parameter, or mismatched buffers.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelError {
    /// `--rule` named no rule.
    #[error("unknown rule {0:?}; known rules: {known}", known = Rule::ALL.map(Rule::name).join(", "))]
    UnknownRule(String),
    /// A hyper-parameter is out of range.
    #[error("invalid hyper-parameter: {0}")]
    BadHyper(String),
    /// The GPU cannot be used, or a CUDA call failed.
    #[error("CUDA: {0}")]
    Device(String),
    /// A failure that is a bug, reported instead of crashing the shard.
    #[error("internal error: {0}")]
    Internal(String),
    /// Buffers do not match the rule's layout.
    #[error("buffers do not match rule {rule}: {detail}")]
    Length {
        /// The rule.
        rule: Rule,
        /// What is off.
        detail: String,
    },
}

impl FromStr for Rule {
    type Err = KernelError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Rule::ALL.into_iter().find(|r| r.name() == s).ok_or_else(|| KernelError::UnknownRule(s.to_string()))
    }
}

/// Hyper-parameters shared by the rules.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hyper {
    /// Learning rate η (> 0).
    pub lr: f32,
    /// Momentum γ in [0, 1).
    pub momentum: f32,
    /// L2 weight decay λ (≥ 0), added to the gradient as λθ (`nadam` decouples it: θ ← θ(1 − ηλ)).
    pub weight_decay: f32,
    /// DC-ASGD λ (constant form) or λ0 (adaptive form), ≥ 0.
    pub dc_lambda: f32,
    /// Decay m of DC-ASGD-adaptive's mean square, in [0, 1).
    pub dc_ms_decay: f32,
}

impl Default for Hyper {
    fn default() -> Self {
        Hyper { lr: 0.1, momentum: 0.9, weight_decay: 0.0, dc_lambda: 2.0, dc_ms_decay: 0.95 }
    }
}

impl Hyper {
    /// The rule and hyper-parameters of one tensor or table: `default_rule` and `self` (the shard's flags)
    /// with the layout file's overrides on top, validated.
    pub fn resolve(
        &self,
        default_rule: Rule,
        overrides: &gaps_common::layout::RuleOverride,
    ) -> Result<(Rule, Hyper), KernelError> {
        let rule = match &overrides.rule {
            Some(name) => name.parse()?,
            None => default_rule,
        };
        let hyper = Hyper {
            lr: overrides.lr.unwrap_or(self.lr),
            momentum: overrides.momentum.unwrap_or(self.momentum),
            weight_decay: overrides.weight_decay.unwrap_or(self.weight_decay),
            dc_lambda: overrides.dc_lambda.unwrap_or(self.dc_lambda),
            dc_ms_decay: overrides.dc_ms_decay.unwrap_or(self.dc_ms_decay),
        };
        hyper.validate()?;
        Ok((rule, hyper))
    }

    /// Checks ranges; a configuration from a user goes through this once at start-up.
    pub fn validate(&self) -> Result<(), KernelError> {
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(KernelError::BadHyper(format!("lr must be a positive number, got {}", self.lr)));
        }
        if !(0.0..1.0).contains(&self.momentum) {
            return Err(KernelError::BadHyper(format!("momentum must be in [0, 1), got {}", self.momentum)));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(KernelError::BadHyper(format!("weight decay must be ≥ 0, got {}", self.weight_decay)));
        }
        if !(self.dc_lambda.is_finite() && self.dc_lambda >= 0.0) {
            return Err(KernelError::BadHyper(format!("dc-lambda must be ≥ 0, got {}", self.dc_lambda)));
        }
        if !(0.0..1.0).contains(&self.dc_ms_decay) {
            return Err(KernelError::BadHyper(format!("dc-ms-decay must be in [0, 1), got {}", self.dc_ms_decay)));
        }
        Ok(())
    }
}

/// Scalars of one push, computed by the shard.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PushScalars {
    /// Learning rate of this update (η times any schedule or multiplier).
    pub lr: f32,
    /// Largest learning rate used so far (Gap-Aware's η_max), ≥ `lr`.
    pub lr_max: f32,
    /// Staleness τ of the gradient for this block (updates since it was read).
    pub staleness: u64,
    /// How many updates this block has received including this one (≥ 1): the bias-correction count.
    pub t: u64,
    /// Workers pushing to the shard (≥ 1; delay-nesterov's delay scale).
    pub workers: u32,
}

impl PushScalars {
    /// Scalars for a fresh gradient at the configured learning rate.
    pub fn fresh(lr: f32, t: u64) -> Self {
        PushScalars { lr, lr_max: lr, staleness: 0, t, workers: 1 }
    }
}

/// The buffers of one block of parameters; every slice has the block's length `n` or is empty when the
/// rule does not use it. Rules use at most two shared planes and one worker plane.
#[derive(Debug)]
pub struct Bufs<'a> {
    /// θ.
    pub params: &'a mut [f32],
    /// Shared plane 0 (momentum v, DANA's S, Adagrad's accumulator, Adam's m).
    pub s0: &'a mut [f32],
    /// Shared plane 1 (Gap-Aware's EMA, Adam's v).
    pub s1: &'a mut [f32],
    /// The pushing worker's plane (its momentum, or DC-ASGD-adaptive's mean square).
    pub w0: &'a mut [f32],
    /// The gradient (DANA-Slim: the worker's Nesterov step u).
    pub grad: &'a [f32],
    /// The parameters the gradient was computed on (empty unless `layout().needs_read`).
    pub read: &'a [f32],
}

impl<'a> Bufs<'a> {
    /// Buffers from planar storage: `shared` holds `shared_planes × n` floats, `worker` holds
    /// `worker_planes × n` (plane k at `[k·n, (k+1)·n)`).
    pub fn from_planes(
        params: &'a mut [f32],
        shared: &'a mut [f32],
        worker: &'a mut [f32],
        grad: &'a [f32],
        read: &'a [f32],
    ) -> Self {
        let n = params.len();
        let (s0, s1) = if shared.len() >= 2 * n { shared.split_at_mut(n) } else { (shared, &mut [][..]) };
        Bufs { params, s0, s1, w0: worker, grad, read }
    }

    pub(crate) fn check(&self, rule: Rule) -> Result<usize, KernelError> {
        let n = self.params.len();
        let l = rule.layout();
        let bad = |detail: String| Err(KernelError::Length { rule, detail });
        let want = |planes: usize, k: usize| if planes > k { n } else { 0 };
        if self.grad.len() != n {
            return bad(format!("{} gradient values for {n} parameters", self.grad.len()));
        }
        if self.s0.len() != want(l.shared_planes, 0) || self.s1.len() != want(l.shared_planes, 1) {
            return bad(format!(
                "shared planes of {} and {} floats, expected {} planes of {n}",
                self.s0.len(),
                self.s1.len(),
                l.shared_planes
            ));
        }
        if self.w0.len() != want(l.worker_planes, 0) {
            return bad(format!(
                "worker plane of {} floats, expected {} planes of {n}",
                self.w0.len(),
                l.worker_planes
            ));
        }
        if self.read.len() != want(usize::from(l.needs_read), 0) {
            return bad(format!(
                "{} read parameters, expected {}",
                self.read.len(),
                want(usize::from(l.needs_read), 0)
            ));
        }
        Ok(n)
    }

    /// Splits at element `mid` into two blocks.
    fn split_at(self, mid: usize) -> (Bufs<'a>, Bufs<'a>) {
        fn cut(s: &mut [f32], mid: usize) -> (&mut [f32], &mut [f32]) {
            if s.is_empty() {
                (&mut [], &mut [])
            } else {
                s.split_at_mut(mid)
            }
        }
        fn cut_ref(s: &[f32], mid: usize) -> (&[f32], &[f32]) {
            if s.is_empty() {
                (&[], &[])
            } else {
                s.split_at(mid)
            }
        }
        let (p0, p1) = self.params.split_at_mut(mid);
        let (a0, a1) = cut(self.s0, mid);
        let (b0, b1) = cut(self.s1, mid);
        let (w0, w1) = cut(self.w0, mid);
        let (g0, g1) = self.grad.split_at(mid);
        let (r0, r1) = cut_ref(self.read, mid);
        (
            Bufs { params: p0, s0: a0, s1: b0, w0, grad: g0, read: r0 },
            Bufs { params: p1, s0: a1, s1: b1, w0: w1, grad: g1, read: r1 },
        )
    }
}

/// Per-push scalars derived once per block, shared by the fast path and the reference.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Derived {
    pub lr: f32,
    pub gamma: f32,
    pub wd: f32,
    pub lambda: f32,
    pub ms_decay: f32,
    /// 1 / max(τ, 1).
    pub inv_staleness: f32,
    /// Gap-Aware: 1 / (1 − β^t).
    pub ga_bias: f32,
    /// Gap-Aware: η_max.
    pub lr_max: f32,
    /// Adam: 1 / (1 − β1^t) and 1 / (1 − β2^t).
    pub adam_bias1: f32,
    pub adam_bias2: f32,
    /// Delay-nesterov: γ_τ, 1 − γ_τ and the step η/(1 − γ).
    pub nag_gamma: f32,
    pub nag_keep: f32,
    pub nag_lr: f32,
    /// NAdam: the gradient's and the momentum's coefficients η(1−μ_t)/(1−Πμ) and ημ_{t+1}/(1−Πμ·μ_{t+1}),
    /// and the decoupled weight decay's factor 1 − ηλ (bias2 is `adam_bias2`).
    pub nadam_grad: f32,
    pub nadam_mom: f32,
    pub decay: f32,
}

/// NAdam's momentum schedule at `t` (≥ 1) for β1: (μ_t, μ_{t+1}, Π_{k≤t} μ_k), in f64. The product is
/// accumulated term by term until it no longer matters next to 1 (below 1e-12): every factor is below
/// β1·(1 − ½·0.96^(tψ)), which is at most 0.51·β1 for the first 40 steps (0.96^(40ψ) > 0.99), so the
/// product falls below 0.51^40 ≈ 2e-12 within about 40 terms whatever β1 < 1.
pub fn nadam_schedule(beta1: f32, t: u64) -> (f64, f64, f64) {
    let beta1 = f64::from(beta1);
    let decay = 0.96f64.powf(NADAM_PSI);
    let mu = |k: u64| beta1 * (1.0 - 0.5 * decay.powf(k as f64));
    let t = t.max(1);
    // Past 64 steps the product is below 1e-12 whatever β1 (see above): no loop on every later push.
    if t > 64 {
        return (mu(t), mu(t + 1), 0.0);
    }
    let mut product = 1.0f64;
    let mut power = 1.0f64;
    for _ in 0..t {
        power *= decay;
        product *= beta1 * (1.0 - 0.5 * power);
        if product < 1e-12 {
            product = 0.0;
            break;
        }
    }
    (mu(t), mu(t + 1), product)
}

/// Delay-nesterov's momentum for a gradient `staleness` updates old with `workers` pushing:
/// γ + (max(γ, 0.99) − γ)·min(τ, N)/N.
pub fn delay_momentum(gamma: f32, staleness: u64, workers: u32) -> f32 {
    let n = workers.max(1);
    let frac = staleness.min(u64::from(n)) as f32 / n as f32;
    gamma + (NAG_GAMMA_MAX.max(gamma) - gamma) * frac
}

pub(crate) fn derive(rule: Rule, hyper: &Hyper, s: &PushScalars) -> Derived {
    let nag_gamma = delay_momentum(hyper.momentum, s.staleness, s.workers);
    let t = s.t.max(1).min(i32::MAX as u64) as i32;
    // Bias corrections only for the rules that read them: an embedding row's push derives its scalars per
    // row, where three powers of t cost more than a 16-wide Adagrad update.
    let needs = match rule {
        Rule::GapAware | Rule::DanaGa => (true, false),
        Rule::Adam | Rule::Nadam | Rule::GapAdam => (false, true),
        _ => (false, false),
    };
    let power_bias = |beta: f32| (1.0 / (1.0 - f64::from(beta).powi(t))) as f32;
    let bias = |beta: f32, needed: bool| if needed { power_bias(beta) } else { 1.0 };
    let (adam_beta2, (nadam_grad, nadam_mom)) = if rule == Rule::Nadam {
        let (mu, mu_next, product) = nadam_schedule(hyper.momentum, s.t);
        let lr = f64::from(s.lr);
        (NADAM_BETA2, ((lr * (1.0 - mu) / (1.0 - product)) as f32, (lr * mu_next / (1.0 - product * mu_next)) as f32))
    } else {
        (ADAM_BETA2, (0.0, 0.0))
    };
    Derived {
        lr: s.lr,
        gamma: hyper.momentum,
        wd: hyper.weight_decay,
        lambda: hyper.dc_lambda,
        ms_decay: hyper.dc_ms_decay,
        inv_staleness: 1.0 / s.staleness.max(1) as f32,
        ga_bias: bias(GA_BETA, needs.0),
        lr_max: s.lr_max.max(s.lr),
        adam_bias1: bias(ADAM_BETA1, needs.1),
        adam_bias2: bias(adam_beta2, needs.1),
        nag_gamma,
        nag_keep: 1.0 - nag_gamma,
        nag_lr: s.lr / (1.0 - hyper.momentum),
        nadam_grad,
        nadam_mom,
        decay: 1.0 - s.lr * hyper.weight_decay,
    }
}

/// Applies `rule` to one block (the fast path, single thread).
pub fn apply(rule: Rule, hyper: &Hyper, scalars: &PushScalars, bufs: Bufs<'_>) -> Result<(), KernelError> {
    let n = bufs.check(rule)?;
    let k = derive(rule, hyper, scalars);
    fast::apply(rule, &k, n, bufs);
    Ok(())
}

/// A rule's update prepared once for many small blocks that share its constants — the rows of one push to a
/// sparse table, for a rule whose scalars no row changes ([`Rule::scalars_per_row`] false): the derived
/// constants and the instruction set are settled here, and [`RowUpdate::apply`] updates one row in place
/// (its values and state where they lie), the same arithmetic as [`apply`] on that row alone.
#[derive(Debug, Clone, Copy)]
pub struct RowUpdate {
    rule: Rule,
    k: Derived,
    isa: Isa,
}

impl RowUpdate {
    /// The update of `rule` with the push's hyper-parameters and scalars.
    pub fn new(rule: Rule, hyper: &Hyper, scalars: &PushScalars) -> Self {
        RowUpdate { rule, k: derive(rule, hyper, scalars), isa: isa() }
    }

    /// Applies the update to one block (checked as [`apply`] checks it).
    #[inline]
    pub fn apply(&self, bufs: Bufs<'_>) -> Result<(), KernelError> {
        let n = bufs.check(self.rule)?;
        fast::apply_row(self.isa, self.rule, &self.k, n, bufs);
        Ok(())
    }
}

/// Below this many parameters a block is updated on the calling thread.
pub const PAR_MIN_PARAMS: usize = 1 << 17;

/// Applies `rule` to one block, split over up to `threads` tasks of the rayon pool when the block is large.
pub fn apply_par(
    rule: Rule,
    hyper: &Hyper,
    scalars: &PushScalars,
    bufs: Bufs<'_>,
    threads: usize,
) -> Result<(), KernelError> {
    bufs.check(rule)?;
    let k = derive(rule, hyper, scalars);
    in_parallel(bufs, threads, move |len, part| fast::apply(rule, &k, len, part));
    Ok(())
}

/// Runs `f` over `bufs` cut into up to `threads` contiguous parts (at least `PAR_MIN_PARAMS / 2` elements
/// each) on the rayon pool, the last part on the calling thread.
fn in_parallel(bufs: Bufs<'_>, threads: usize, f: impl Fn(usize, Bufs<'_>) + Copy + Send + Sync) {
    let n = bufs.params.len();
    let threads = threads.clamp(1, (n / (PAR_MIN_PARAMS / 2)).max(1));
    if threads == 1 {
        return f(n, bufs);
    }
    // Cut at multiples of 16 elements so every part but the last stays vector-aligned.
    let step = n.div_ceil(threads).div_ceil(16) * 16;
    rayon::scope(|scope| {
        let mut rest = bufs;
        let mut left = n;
        while left > step {
            let (head, tail) = rest.split_at(step);
            scope.spawn(move |_| f(step, head));
            rest = tail;
            left -= step;
        }
        f(left, rest);
    });
}

/// The parameters a pull returns: θ, or for the look-ahead rules (DANA, delay-nesterov) θ − η·c·S with c
/// from [`lookahead_factor`] (`workers`: the live workers, at least 1).
pub fn pull_values(
    rule: Rule,
    hyper: &Hyper,
    lr: f32,
    workers: u32,
    params: &[f32],
    shared: &[f32],
    out: &mut Vec<f32>,
) {
    let start = out.len();
    out.extend_from_slice(params);
    look_ahead(rule, hyper, lr, workers, &mut out[start..], shared);
}

/// [`pull_values`] in place: `values` holds θ and becomes what a pull returns.
pub fn look_ahead(rule: Rule, hyper: &Hyper, lr: f32, workers: u32, values: &mut [f32], shared: &[f32]) {
    if rule.layout().lookahead && shared.len() >= values.len() {
        let c = lr * lookahead_factor(rule, hyper.momentum, workers);
        let n = values.len();
        values.iter_mut().zip(&shared[..n]).for_each(|(p, s)| *p -= c * s);
    }
}

/// The multiple of η·S a pull subtracts (S: shared plane 0): γ for the DANA rules, whose S sums every
/// worker's momentum; for delay-nesterov, whose S is the averaged momentum m = (1 − γ)·v, γ·N/(1 − γ):
/// the parameters extrapolated over the N updates expected before the gradient comes back.
pub fn lookahead_factor(rule: Rule, gamma: f32, workers: u32) -> f32 {
    match rule {
        Rule::DelayNesterov => gamma * workers.max(1) as f32 / (1.0 - gamma),
        _ => gamma,
    }
}

/// DANA-Slim's worker half: with the pulled parameters Θ and the gradient g computed there, updates the
/// worker's momentum v ← γv + (g + λΘ) and returns the step u = γv + (g + λΘ) to push, in place of g.
pub fn slim_worker_step(hyper: &Hyper, pulled: &[f32], momentum: &mut [f32], grad: &mut [f32]) {
    let (gamma, wd) = (hyper.momentum, hyper.weight_decay);
    for ((g, v), p) in grad.iter_mut().zip(momentum.iter_mut()).zip(pulled) {
        let d = *g + wd * p;
        *v = gamma * *v + d;
        *g = gamma * *v + d;
    }
}

mod fast;
pub use fast::{detected, isa, Isa};

#[cfg(test)]
mod tests;

/// The memory-bandwidth yardstick for a rule: one fused streaming pass that reads exactly the planes the
/// rule reads (θ, g, the read echo, every state plane) and writes exactly the planes it writes, with one
/// addition per element, split over `threads` like [`apply_par`]. `params_per_s(rule) / params_per_s(stream)`
/// is how close the rule runs to the machine's bandwidth for its bytes.
pub fn stream_baseline(bufs: Bufs<'_>, threads: usize) {
    in_parallel(bufs, threads, |_, part| stream_block(part));
}

fn stream_block(b: Bufs<'_>) {
    fast::stream(b)
}
