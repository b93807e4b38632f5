//! Training tasks of the simulator, all synthetic and seeded:
//!
//! - `mlp`: the teacher–student task of docs/ALGORITHMS.md §7 (E1) — x ∈ R²⁰ ~ N(0, I); a teacher 20→32 tanh→10 labels
//!   each x by argmax, 5 % of labels replaced at random; 16,384 training and 4,096 test samples; the student
//!   is a 20→64 ReLU→10 MLP (He initialisation) trained with softmax cross-entropy. Metric: test accuracy %.
//! - `quadratic`: f(x) = ½ Σ h_j x_j² with h log-spaced over [1e-3, 1] and Gaussian gradient noise per
//!   batch. Metric: the final loss f(x) (lower is better).
//! - `logreg`: the worker's built-in logistic regression on 64 features. Metric: test accuracy %.

use gaps_common::rng::{mix, Rng};
use gaps_models::data::SyntheticLogreg;

/// A task the simulator trains. Parameters are one flat vector.
pub trait Task: Sync {
    /// `--model` name.
    fn name(&self) -> &'static str;
    /// Number of parameters.
    fn num_params(&self) -> usize;
    /// Initial parameters.
    fn init(&self, seed: u64) -> Vec<f32>;
    /// Training samples (one epoch).
    fn train_size(&self) -> usize;
    /// Mean loss over the batch of training indices; writes the mean gradient into `grad`.
    fn loss_grad(&self, params: &[f32], batch: &[u32], batch_id: u64, grad: &mut [f32]) -> f32;
    /// (test metric, training loss over the whole training set).
    fn evaluate(&self, params: &[f32]) -> (f64, f64);
    /// What the metric is.
    fn metric_name(&self) -> &'static str;
    /// The test metric alone (what a time-to-target curve samples; cheaper than [`Task::evaluate`]).
    fn test_metric(&self, params: &[f32]) -> f64 {
        self.evaluate(params).0
    }
    /// True when a larger metric is better (accuracy, AUC); false for a loss.
    fn higher_is_better(&self) -> bool {
        true
    }
    /// Embedding tasks: the first this many parameters are rows of dim 1 of a sparse table (row id = index),
    /// pulled and pushed per id through the shard's table 0 as a real recommendation worker does; the rest
    /// is the dense tensor. 0: a dense task.
    fn sparse_rows(&self) -> usize {
        0
    }
    /// The distinct row ids a batch touches, ascending (embedding tasks).
    fn batch_rows(&self, _batch: &[u32]) -> Vec<u64> {
        Vec::new()
    }
}

const IN: usize = 20;
const HIDDEN: usize = 64;
const CLASSES: usize = 10;
const TEACHER_HIDDEN: usize = 32;
// Offsets of the student's tensors in the flat parameter vector.
const W1: usize = 0;
const B1: usize = W1 + HIDDEN * IN;
const W2: usize = B1 + HIDDEN;
const B2: usize = W2 + CLASSES * HIDDEN;
const MLP_PARAMS: usize = B2 + CLASSES;

/// The teacher–student MLP task.
#[derive(Debug, Clone)]
pub struct Mlp {
    x_train: Vec<f32>,
    y_train: Vec<u8>,
    x_test: Vec<f32>,
    y_test: Vec<u8>,
}

impl Mlp {
    /// Generates the data of `seed` (train and test sizes as in §11 unless given).
    pub fn new(seed: u64, train: usize, test: usize) -> Self {
        let mut rng = Rng::new(mix(seed, 0x07ea_c4e5));
        let w1: Vec<f32> = (0..TEACHER_HIDDEN * IN).map(|_| (rng.normal() / (IN as f64).sqrt()) as f32).collect();
        let w2: Vec<f32> =
            (0..CLASSES * TEACHER_HIDDEN).map(|_| (rng.normal() / (TEACHER_HIDDEN as f64).sqrt()) as f32).collect();
        let mut make = |n: usize| {
            let mut xs = vec![0.0f32; n * IN];
            let mut ys = vec![0u8; n];
            for i in 0..n {
                let x = &mut xs[i * IN..(i + 1) * IN];
                x.iter_mut().for_each(|v| *v = rng.normal() as f32);
                let h: Vec<f32> =
                    (0..TEACHER_HIDDEN).map(|j| (0..IN).map(|k| w1[j * IN + k] * x[k]).sum::<f32>().tanh()).collect();
                let mut best = (0, f32::NEG_INFINITY);
                for c in 0..CLASSES {
                    let z: f32 = (0..TEACHER_HIDDEN).map(|j| w2[c * TEACHER_HIDDEN + j] * h[j]).sum();
                    if z > best.1 {
                        best = (c, z);
                    }
                }
                ys[i] = if rng.uniform() < 0.05 { rng.below(CLASSES as u64) as u8 } else { best.0 as u8 };
            }
            (xs, ys)
        };
        let (x_train, y_train) = make(train);
        let (x_test, y_test) = make(test);
        Mlp { x_train, y_train, x_test, y_test }
    }

    /// Forward pass of one sample: hidden activations and class probabilities.
    fn forward(params: &[f32], x: &[f32], h: &mut [f32; HIDDEN], p: &mut [f32; CLASSES]) {
        for j in 0..HIDDEN {
            let row = &params[W1 + j * IN..W1 + (j + 1) * IN];
            let z: f32 = params[B1 + j] + row.iter().zip(x).map(|(w, x)| w * x).sum::<f32>();
            h[j] = z.max(0.0);
        }
        let mut max = f32::NEG_INFINITY;
        for c in 0..CLASSES {
            let row = &params[W2 + c * HIDDEN..W2 + (c + 1) * HIDDEN];
            p[c] = params[B2 + c] + row.iter().zip(h.iter()).map(|(w, h)| w * h).sum::<f32>();
            max = max.max(p[c]);
        }
        let mut sum = 0.0;
        for v in p.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        p.iter_mut().for_each(|v| *v /= sum);
    }

    fn mean_loss_and_accuracy(params: &[f32], xs: &[f32], ys: &[u8]) -> (f64, f64) {
        let (mut h, mut p) = ([0.0; HIDDEN], [0.0; CLASSES]);
        let (mut loss, mut correct) = (0.0f64, 0usize);
        for (i, y) in ys.iter().enumerate() {
            Self::forward(params, &xs[i * IN..(i + 1) * IN], &mut h, &mut p);
            loss -= f64::from(p[*y as usize].max(1e-12).ln());
            let argmax = (0..CLASSES).fold(0, |b, c| if p[c] > p[b] { c } else { b });
            correct += usize::from(argmax == *y as usize);
        }
        let n = ys.len().max(1) as f64;
        (loss / n, 100.0 * correct as f64 / n)
    }
}

impl Task for Mlp {
    fn name(&self) -> &'static str {
        "mlp"
    }
    fn num_params(&self) -> usize {
        MLP_PARAMS
    }
    fn init(&self, seed: u64) -> Vec<f32> {
        // He initialisation for the weights, zero biases.
        let mut rng = Rng::new(mix(seed, 0x1417));
        let mut p = vec![0.0f32; MLP_PARAMS];
        let he = |fan_in: usize| (2.0 / fan_in as f64).sqrt();
        p[W1..B1].iter_mut().for_each(|v| *v = (rng.normal() * he(IN)) as f32);
        p[W2..B2].iter_mut().for_each(|v| *v = (rng.normal() * he(HIDDEN)) as f32);
        p
    }
    fn train_size(&self) -> usize {
        self.y_train.len()
    }
    fn loss_grad(&self, params: &[f32], batch: &[u32], _batch_id: u64, grad: &mut [f32]) -> f32 {
        grad.iter_mut().for_each(|g| *g = 0.0);
        let (mut h, mut p) = ([0.0; HIDDEN], [0.0; CLASSES]);
        let scale = 1.0 / batch.len().max(1) as f32;
        let mut loss = 0.0f32;
        for &i in batch {
            let i = i as usize;
            let x = &self.x_train[i * IN..(i + 1) * IN];
            let y = self.y_train[i] as usize;
            Self::forward(params, x, &mut h, &mut p);
            loss -= p[y].max(1e-12).ln();
            // dL/dlogits = p − onehot(y), averaged over the batch.
            let mut dz = p;
            dz[y] -= 1.0;
            dz.iter_mut().for_each(|v| *v *= scale);
            let mut dh = [0.0f32; HIDDEN];
            for c in 0..CLASSES {
                grad[B2 + c] += dz[c];
                let (w_row, g_row) = (W2 + c * HIDDEN, W2 + c * HIDDEN);
                for j in 0..HIDDEN {
                    grad[g_row + j] += dz[c] * h[j];
                    dh[j] += params[w_row + j] * dz[c];
                }
            }
            for j in 0..HIDDEN {
                if h[j] <= 0.0 {
                    continue;
                }
                grad[B1 + j] += dh[j];
                let row = &mut grad[W1 + j * IN..W1 + (j + 1) * IN];
                row.iter_mut().zip(x).for_each(|(g, x)| *g += dh[j] * x);
            }
        }
        loss * scale
    }
    fn evaluate(&self, params: &[f32]) -> (f64, f64) {
        let (_, accuracy) = Self::mean_loss_and_accuracy(params, &self.x_test, &self.y_test);
        let (train_loss, _) = Self::mean_loss_and_accuracy(params, &self.x_train, &self.y_train);
        (accuracy, train_loss)
    }
    fn metric_name(&self) -> &'static str {
        "test accuracy %"
    }
    fn test_metric(&self, params: &[f32]) -> f64 {
        Self::mean_loss_and_accuracy(params, &self.x_test, &self.y_test).1
    }
}

/// The noisy quadratic ½ Σ h_j x_j².
#[derive(Debug, Clone)]
pub struct Quadratic {
    curvature: Vec<f32>,
    noise: f32,
    seed: u64,
    train: usize,
}

impl Quadratic {
    /// `dim` coordinates with curvatures log-spaced over [1e-3, 1]; gradient noise σ per batch.
    pub fn new(dim: usize, noise: f32, seed: u64, train: usize) -> Self {
        let curvature = (0..dim).map(|j| 10f32.powf(-3.0 + 3.0 * j as f32 / (dim.max(2) - 1) as f32)).collect();
        Quadratic { curvature, noise, seed, train }
    }
}

impl Task for Quadratic {
    fn name(&self) -> &'static str {
        "quadratic"
    }
    fn num_params(&self) -> usize {
        self.curvature.len()
    }
    fn init(&self, _seed: u64) -> Vec<f32> {
        vec![1.0; self.curvature.len()]
    }
    fn train_size(&self) -> usize {
        self.train
    }
    fn loss_grad(&self, params: &[f32], batch: &[u32], batch_id: u64, grad: &mut [f32]) -> f32 {
        let mut rng = Rng::new(mix(self.seed, batch_id));
        let sigma = self.noise / (batch.len().max(1) as f32).sqrt();
        let mut loss = 0.0;
        for ((g, x), h) in grad.iter_mut().zip(params).zip(&self.curvature) {
            *g = h * x + sigma * rng.normal() as f32;
            loss += 0.5 * h * x * x;
        }
        loss
    }
    fn evaluate(&self, params: &[f32]) -> (f64, f64) {
        let loss: f64 =
            params.iter().zip(&self.curvature).map(|(x, h)| 0.5 * f64::from(*h) * f64::from(*x).powi(2)).sum();
        (loss, loss)
    }
    fn metric_name(&self) -> &'static str {
        "final loss"
    }
    fn higher_is_better(&self) -> bool {
        false
    }
}

/// Logistic regression on the worker's synthetic data (64 features plus a bias).
#[derive(Debug, Clone)]
pub struct Logreg {
    data: SyntheticLogreg,
    train: usize,
    test: usize,
}

const LOGREG_DIM: usize = 64;

impl Logreg {
    /// The dataset of `seed`.
    pub fn new(seed: u64, train: usize, test: usize) -> Self {
        Logreg { data: SyntheticLogreg::new(LOGREG_DIM, seed), train, test }
    }

    fn loss_acc(&self, params: &[f32], first: u64, n: usize) -> (f64, f64) {
        let mut x = vec![0.0f32; LOGREG_DIM];
        let (mut loss, mut correct) = (0.0f64, 0usize);
        for i in 0..n as u64 {
            let y = self.data.sample(first + i, &mut x);
            let z = params[LOGREG_DIM] + x.iter().zip(params).map(|(x, w)| x * w).sum::<f32>();
            let p = (1.0 / (1.0 + (-f64::from(z)).exp())).clamp(1e-7, 1.0 - 1e-7);
            loss -= if y > 0.5 { p.ln() } else { (1.0 - p).ln() };
            correct += usize::from((p > 0.5) == (y > 0.5));
        }
        (loss / n.max(1) as f64, 100.0 * correct as f64 / n.max(1) as f64)
    }
}

impl Task for Logreg {
    fn name(&self) -> &'static str {
        "logreg"
    }
    fn num_params(&self) -> usize {
        LOGREG_DIM + 1
    }
    fn init(&self, _seed: u64) -> Vec<f32> {
        vec![0.0; LOGREG_DIM + 1]
    }
    fn train_size(&self) -> usize {
        self.train
    }
    fn loss_grad(&self, params: &[f32], batch: &[u32], _batch_id: u64, grad: &mut [f32]) -> f32 {
        let mut x = vec![0.0f32; LOGREG_DIM];
        grad.iter_mut().for_each(|g| *g = 0.0);
        let scale = 1.0 / batch.len().max(1) as f32;
        let mut loss = 0.0;
        for &i in batch {
            let y = self.data.sample(u64::from(i), &mut x);
            let z = params[LOGREG_DIM] + x.iter().zip(params).map(|(x, w)| x * w).sum::<f32>();
            let p = (1.0 / (1.0 + (-z).exp())).clamp(1e-7, 1.0 - 1e-7);
            loss -= if y > 0.5 { p.ln() } else { (1.0 - p).ln() };
            let r = (p - y) * scale;
            grad[..LOGREG_DIM].iter_mut().zip(&x).for_each(|(g, x)| *g += r * x);
            grad[LOGREG_DIM] += r;
        }
        loss * scale
    }
    fn evaluate(&self, params: &[f32]) -> (f64, f64) {
        let (_, accuracy) = self.loss_acc(params, gaps_models::data::EVAL_BASE, self.test);
        let (train_loss, _) = self.loss_acc(params, 0, self.train.min(8192));
        (accuracy, train_loss)
    }
    fn metric_name(&self) -> &'static str {
        "test accuracy %"
    }
}

/// Click-through logistic regression on the synthetic Criteo data: each (field, value) feature hashed into
/// one of 2^16 buckets, plus the 13 log-transformed integer features and a bias. Metric: test AUC. The
/// bucket weights are the rows of a sparse table (dim 1), the 14 others a dense tensor.
#[derive(Debug, Clone)]
pub struct Ctr {
    train: CtrSamples,
    test: CtrSamples,
    /// The buckets are rows of a sparse table (false: one dense tensor, the reference of that path).
    sparse: bool,
}

const CTR_BUCKETS: usize = 1 << 16;
const CTR_PARAMS: usize = CTR_BUCKETS + 13 + 1;

#[derive(Debug, Clone)]
struct CtrSamples {
    buckets: Vec<u32>,
    ints: Vec<f32>,
    labels: Vec<u8>,
}

impl CtrSamples {
    fn new(data: &gaps_models::criteo::SyntheticCriteo, first: u64, n: usize) -> Self {
        let mut out = CtrSamples {
            buckets: Vec::with_capacity(n * 26),
            ints: Vec::with_capacity(n * 13),
            labels: Vec::with_capacity(n),
        };
        for i in 0..n as u64 {
            let (s, _) = data.sample(first + i);
            for f in 0..26 {
                // Missing fields hash to a bucket of their own per field.
                let id = s.feature_id(f).unwrap_or(u64::MAX - f as u64);
                out.buckets.push((mix(id, 0xb0c) % CTR_BUCKETS as u64) as u32);
            }
            out.ints.extend((0..13).map(|j| s.log_int(j)));
            out.labels.push(s.label);
        }
        out
    }

    fn logit(&self, params: &[f32], i: usize) -> f32 {
        let mut z = params[CTR_PARAMS - 1];
        for b in &self.buckets[i * 26..(i + 1) * 26] {
            z += params[*b as usize];
        }
        for (j, x) in self.ints[i * 13..(i + 1) * 13].iter().enumerate() {
            z += params[CTR_BUCKETS + j] * x;
        }
        z
    }
}

impl Ctr {
    /// Training samples 0.. and held-out samples from the generator's evaluation range.
    pub fn new(seed: u64, train: usize, test: usize) -> Self {
        let data = gaps_models::criteo::SyntheticCriteo::new(seed);
        Ctr {
            train: CtrSamples::new(&data, 0, train),
            test: CtrSamples::new(&data, gaps_models::criteo::SYNTHETIC_EVAL_BASE, test),
            sparse: true,
        }
    }

    /// The same model with the bucket weights in the dense tensor.
    pub fn dense(seed: u64, train: usize, test: usize) -> Self {
        Ctr { sparse: false, ..Ctr::new(seed, train, test) }
    }
}

fn sigmoid64(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

impl Task for Ctr {
    fn name(&self) -> &'static str {
        if self.sparse {
            "ctr"
        } else {
            "ctr-dense"
        }
    }
    fn num_params(&self) -> usize {
        CTR_PARAMS
    }
    fn init(&self, _seed: u64) -> Vec<f32> {
        vec![0.0; CTR_PARAMS]
    }
    fn train_size(&self) -> usize {
        self.train.labels.len()
    }
    fn loss_grad(&self, params: &[f32], batch: &[u32], _batch_id: u64, grad: &mut [f32]) -> f32 {
        grad.iter_mut().for_each(|g| *g = 0.0);
        let scale = 1.0 / batch.len().max(1) as f32;
        let mut loss = 0.0;
        for &i in batch {
            let i = i as usize;
            let p = sigmoid64(self.train.logit(params, i)).clamp(1e-7, 1.0 - 1e-7);
            let y = f32::from(self.train.labels[i]);
            loss -= y * p.ln() + (1.0 - y) * (1.0 - p).ln();
            let r = (p - y) * scale;
            for b in &self.train.buckets[i * 26..(i + 1) * 26] {
                grad[*b as usize] += r;
            }
            for (j, x) in self.train.ints[i * 13..(i + 1) * 13].iter().enumerate() {
                grad[CTR_BUCKETS + j] += r * x;
            }
            grad[CTR_PARAMS - 1] += r;
        }
        loss * scale
    }
    fn evaluate(&self, params: &[f32]) -> (f64, f64) {
        let scores: Vec<f32> = (0..self.test.labels.len()).map(|i| sigmoid64(self.test.logit(params, i))).collect();
        let auc = gaps_models::criteo::auc(&scores, &self.test.labels);
        let n = self.train.labels.len().min(16_384);
        let loss = (0..n)
            .map(|i| {
                let p = f64::from(sigmoid64(self.train.logit(params, i))).clamp(1e-7, 1.0 - 1e-7);
                if self.train.labels[i] == 1 {
                    -p.ln()
                } else {
                    -(1.0 - p).ln()
                }
            })
            .sum::<f64>()
            / n.max(1) as f64;
        (auc, loss)
    }
    fn metric_name(&self) -> &'static str {
        "test AUC"
    }
    fn sparse_rows(&self) -> usize {
        if self.sparse {
            CTR_BUCKETS
        } else {
            0
        }
    }
    fn batch_rows(&self, batch: &[u32]) -> Vec<u64> {
        let mut ids: Vec<u64> = batch
            .iter()
            .flat_map(|&i| self.train.buckets[i as usize * 26..(i as usize + 1) * 26].iter().map(|b| u64::from(*b)))
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }
    fn test_metric(&self, params: &[f32]) -> f64 {
        let scores: Vec<f32> = (0..self.test.labels.len()).map(|i| sigmoid64(self.test.logit(params, i))).collect();
        gaps_models::criteo::auc(&scores, &self.test.labels)
    }
}
