//! Plain scalar reference implementations: the oracle the fast paths are tested against. Written for
//! clarity, one parameter at a time, exactly as ALGORITHMS.md states each rule.

use crate::{Hyper, Rule};

/// Applies `rule` parameter by parameter. Same contract as [`crate::apply`], lengths unchecked beyond
/// indexing.
pub fn apply(rule: Rule, hyper: &Hyper, params: &mut [f32], state: &mut [f32], grad: &[f32]) {
    for i in 0..params.len() {
        let d = grad[i] + hyper.weight_decay * params[i];
        match rule {
            Rule::Sgd => params[i] -= hyper.lr * d,
            Rule::Momentum => {
                state[i] = hyper.momentum * state[i] + d;
                params[i] -= hyper.lr * state[i];
            }
        }
    }
}
