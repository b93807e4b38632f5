//! A small deterministic random number generator (xoshiro256++ seeded by SplitMix64).
//!
//! Used wherever results must be bit-reproducible for a seed (initialisers, synthetic data, the simulator).
//! It is written here rather than taken from `rand` on purpose: the streams (and the Gamma and normal
//! draws built on them) are part of the results — a seed must give the same model, data and simulation
//! after any dependency upgrade, and `rand` does not promise value stability of its distributions across
//! versions.

/// SplitMix64 step: a good 64-bit mixer, also used to derive independent seeds from (seed, index).
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Mixes a seed with a stream index into a new seed (counter-based streams).
pub fn mix(seed: u64, index: u64) -> u64 {
    let mut s = seed ^ index.wrapping_mul(0xd134_2543_de82_ef95);
    splitmix64(&mut s)
}

/// xoshiro256++ generator.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// The generator's state (to continue it elsewhere with [`Rng::from_state`]).
    pub fn state(&self) -> [u64; 4] {
        self.s
    }

    /// A generator continuing one whose [`Rng::state`] this was.
    pub fn from_state(s: [u64; 4]) -> Self {
        Rng { s }
    }

    /// A generator seeded from one 64-bit seed.
    pub fn new(seed: u64) -> Self {
        let mut sm = seed;
        let s = [splitmix64(&mut sm), splitmix64(&mut sm), splitmix64(&mut sm), splitmix64(&mut sm)];
        Rng { s }
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let result = (self.s[0].wrapping_add(self.s[3])).rotate_left(23).wrapping_add(self.s[0]);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 bits of precision.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in [0, n) (n > 0), by Lemire's multiply-shift (bias < 2^-64·n, negligible).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Standard normal by Box–Muller (one of the pair is discarded to keep the generator stateless).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform(); // (0, 1]
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

impl Rng {
    /// Gamma(shape, scale) by Marsaglia–Tsang; for shape < 1, Gamma(shape + 1)·U^(1/shape). Mean
    /// shape·scale. Both arguments must be positive and finite (callers validate user input).
    pub fn gamma(&mut self, shape: f64, scale: f64) -> f64 {
        if shape < 1.0 {
            let u = 1.0 - self.uniform();
            return self.gamma(shape + 1.0, scale) * u.powf(1.0 / shape);
        }
        let d = shape - 1.0 / 3.0;
        let c = 1.0 / (9.0 * d).sqrt();
        loop {
            let x = self.normal();
            let v = 1.0 + c * x;
            if v <= 0.0 {
                continue;
            }
            let v = v * v * v;
            let u = 1.0 - self.uniform();
            if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
                return d * v * scale;
            }
        }
    }

    /// A uniformly random permutation of 0..n (Fisher–Yates).
    pub fn permutation(&mut self, n: usize) -> Vec<u32> {
        let mut p: Vec<u32> = (0..n as u32).collect();
        for i in (1..n).rev() {
            let j = self.below(i as u64 + 1) as usize;
            p.swap(i, j);
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_sane_moments() {
        let mut a = Rng::new(7);
        let mut b = Rng::new(7);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        let mut r = Rng::new(1);
        let n = 20_000;
        let (mut sum, mut sq) = (0.0, 0.0);
        for _ in 0..n {
            let x = r.normal();
            sum += x;
            sq += x * x;
        }
        let mean = sum / n as f64;
        let var = sq / n as f64 - mean * mean;
        assert!(mean.abs() < 0.05, "mean {mean}");
        assert!((var - 1.0).abs() < 0.05, "var {var}");
        assert_ne!(mix(1, 2), mix(1, 3));
    }

    #[test]
    fn gamma_has_the_right_mean_and_spread() {
        let mut r = Rng::new(3);
        for (shape, scale) in [(100.0, 0.32), (1.0, 2.0), (0.5, 1.0)] {
            let n = 20_000;
            let xs: Vec<f64> = (0..n).map(|_| r.gamma(shape, scale)).collect();
            let mean = xs.iter().sum::<f64>() / n as f64;
            let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
            assert!((mean / (shape * scale) - 1.0).abs() < 0.03, "shape {shape}: mean {mean}");
            assert!((var / (shape * scale * scale) - 1.0).abs() < 0.1, "shape {shape}: var {var}");
        }
        let p = r.permutation(100);
        let mut sorted = p.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<u32>>());
    }
}
