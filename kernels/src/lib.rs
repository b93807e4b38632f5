//! gaps-kernels: the update rules a shard applies to its parameters.
//!
//! Every rule is a pure function of (hyper-parameters, parameters, optimizer state, gradient) with a
//! documented state layout. [`reference`] holds the plain scalar implementation (the oracle for tests);
//! [`apply`] is the fast path used by the server.
//!
//! Architecture invariant: no I/O, no async runtime, no allocation on the update path.

use std::fmt;
use std::str::FromStr;

pub mod reference;

/// The update rules, selected by name with `--rule`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rule {
    /// Plain SGD: θ ← θ − η·(g + λθ). State: none.
    Sgd,
    /// Heavy-ball momentum, PyTorch form: v ← γv + (g + λθ); θ ← θ − ηv. State: v (1 float/param).
    Momentum,
}

impl Rule {
    /// Every rule, in documentation order.
    pub const ALL: [Rule; 2] = [Rule::Sgd, Rule::Momentum];

    /// The name used by `--rule`.
    pub fn name(self) -> &'static str {
        match self {
            Rule::Sgd => "sgd",
            Rule::Momentum => "momentum",
        }
    }

    /// Optimizer-state floats the server keeps per parameter.
    pub fn state_floats(self) -> usize {
        match self {
            Rule::Sgd => 0,
            Rule::Momentum => 1,
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown rule name or an invalid hyper-parameter.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelError {
    /// `--rule` named no rule.
    #[error("unknown rule {0:?}; known rules: {known}", known = Rule::ALL.map(Rule::name).join(", "))]
    UnknownRule(String),
    /// A hyper-parameter is out of range.
    #[error("invalid hyper-parameter: {0}")]
    BadHyper(String),
    /// Slices of different lengths were passed.
    #[error("length mismatch: params {params}, state {state}, grad {grad}")]
    Length {
        /// Parameter count.
        params: usize,
        /// State floats.
        state: usize,
        /// Gradient count.
        grad: usize,
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
    /// L2 weight decay λ (≥ 0), added to the gradient as λθ.
    pub weight_decay: f32,
}

impl Default for Hyper {
    fn default() -> Self {
        Hyper { lr: 0.1, momentum: 0.9, weight_decay: 0.0 }
    }
}

impl Hyper {
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
        Ok(())
    }
}

/// Applies `rule` to one contiguous block: `params` and `grad` have the same length, `state` holds
/// `rule.state_floats()` floats per parameter laid out as consecutive planes (`state[k*n..(k+1)*n]`).
pub fn apply(
    rule: Rule,
    hyper: &Hyper,
    params: &mut [f32],
    state: &mut [f32],
    grad: &[f32],
) -> Result<(), KernelError> {
    let n = params.len();
    if grad.len() != n || state.len() != rule.state_floats() * n {
        return Err(KernelError::Length { params: n, state: state.len(), grad: grad.len() });
    }
    let (lr, gamma, wd) = (hyper.lr, hyper.momentum, hyper.weight_decay);
    match rule {
        Rule::Sgd => {
            for (p, g) in params.iter_mut().zip(grad) {
                *p -= lr * (*g + wd * *p);
            }
        }
        Rule::Momentum => {
            for ((p, v), g) in params.iter_mut().zip(state.iter_mut()).zip(grad) {
                let d = *g + wd * *p;
                *v = gamma * *v + d;
                *p -= lr * *v;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn fast_path_matches_reference_on_random_inputs() {
        let hyper = Hyper { lr: 0.05, momentum: 0.9, weight_decay: 1e-4 };
        for rule in Rule::ALL {
            let n = 1003;
            let mut p_fast = random(n, 1);
            let mut s_fast = random(n * rule.state_floats(), 2);
            let mut p_ref = p_fast.clone();
            let mut s_ref = s_fast.clone();
            for step in 0..5 {
                let g = random(n, 10 + step);
                apply(rule, &hyper, &mut p_fast, &mut s_fast, &g).expect("apply");
                reference::apply(rule, &hyper, &mut p_ref, &mut s_ref, &g);
            }
            for (a, b) in p_fast.iter().zip(&p_ref) {
                assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{rule}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn names_parse_and_bad_input_is_refused() {
        for rule in Rule::ALL {
            assert_eq!(rule.name().parse::<Rule>().expect("parse"), rule);
        }
        assert!(matches!("adamw".parse::<Rule>(), Err(KernelError::UnknownRule(_))));
        assert!(Hyper { lr: -1.0, ..Hyper::default() }.validate().is_err());
        assert!(Hyper { momentum: 1.0, ..Hyper::default() }.validate().is_err());
        let mut p = vec![0.0; 3];
        assert!(apply(Rule::Momentum, &Hyper::default(), &mut p, &mut [], &[0.0; 3]).is_err());
    }
}
