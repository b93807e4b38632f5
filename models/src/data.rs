//! Seeded synthetic data for the built-in models.
//!
//! Samples are addressed by a 64-bit index and generated from `(seed, index)` alone, so any process
//! (worker, `gaps local`'s evaluator, a test) draws the same sample for the same index without coordination.
//! Training workers use disjoint index streams; evaluation uses a held-out range.

use gaps_common::rng::{mix, Rng};

/// First index of the held-out evaluation range (training streams never reach it).
pub const EVAL_BASE: u64 = 1 << 62;

/// Binary classification with a planted linear teacher: x ~ N(0, I), y = [w*·x + b* + ε > 0] with
/// ε ~ N(0, `noise`²) and ‖w*‖ = 1, so the best achievable log-loss is small but not zero.
#[derive(Debug, Clone)]
pub struct SyntheticLogreg {
    /// Feature dimension.
    pub dim: usize,
    seed: u64,
    teacher: Vec<f32>,
    teacher_bias: f32,
    noise: f32,
}

impl SyntheticLogreg {
    /// The dataset of a seed (the teacher depends only on `seed` and `dim`).
    pub fn new(dim: usize, seed: u64) -> Self {
        let mut rng = Rng::new(mix(seed, u64::MAX));
        let mut teacher: Vec<f32> = (0..dim).map(|_| rng.normal() as f32).collect();
        let norm = teacher.iter().map(|w| w * w).sum::<f32>().sqrt().max(f32::MIN_POSITIVE);
        teacher.iter_mut().for_each(|w| *w /= norm);
        SyntheticLogreg { dim, seed, teacher, teacher_bias: 0.25, noise: 0.1 }
    }

    /// Writes sample `index`'s features into `x` (length `dim`) and returns its label (0 or 1).
    pub fn sample(&self, index: u64, x: &mut [f32]) -> f32 {
        let mut rng = Rng::new(mix(self.seed, index));
        let mut z = self.teacher_bias;
        for (xi, wi) in x.iter_mut().zip(&self.teacher) {
            *xi = rng.normal() as f32;
            z += *xi * *wi;
        }
        z += self.noise * rng.normal() as f32;
        if z > 0.0 {
            1.0
        } else {
            0.0
        }
    }

    /// A batch of `n` samples starting at `first`: features row-major (`n × dim`) and labels.
    pub fn batch(&self, first: u64, n: usize) -> (Vec<f32>, Vec<f32>) {
        let mut xs = vec![0.0; n * self.dim];
        let labels = (0..n).map(|i| self.sample(first + i as u64, &mut xs[i * self.dim..(i + 1) * self.dim])).collect();
        (xs, labels)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_reproducible_and_balanced_enough() {
        let d = SyntheticLogreg::new(16, 3);
        let (a, la) = d.batch(100, 50);
        let (b, lb) = d.batch(100, 50);
        assert_eq!(a, b);
        assert_eq!(la, lb);
        let (_, labels) = d.batch(0, 2000);
        let pos = labels.iter().sum::<f32>() / 2000.0;
        assert!((0.3..0.8).contains(&pos), "positive rate {pos}");
    }
}
