//! Click-through-rate models over the Criteo layout: logistic regression (`lr`), a factorization machine
//! (`fm`) and a DLRM-style model (`dlrm`: one embedding per categorical field, the log-transformed integer
//! features, a one-hidden-layer MLP). Embeddings live in one sparse table per model (feature id = field and
//! hash, see [`Sample::feature_id`]); everything else is dense.
//!
//! A batch is first *indexed*: its distinct feature ids (pulled once, gradients aggregated per id, as the
//! worker must) and, per sample and field, the position of the id in that list.

use crate::criteo::{Sample, NUM_CAT, NUM_INT};
use gaps_common::layout::{Layout, LayoutError, SparseSpec, TensorSpec};
use std::collections::HashMap;

/// Marks a missing categorical field in an indexed batch.
pub const MISSING: u32 = u32::MAX;

/// The CTR models.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CtrModel {
    /// Logistic regression: a weight per feature id and per integer feature.
    Lr,
    /// Factorization machine of rank `embedding_dim`.
    Fm,
    /// Embeddings + integer features → hidden layer (ReLU) → logit.
    Dlrm,
}

impl CtrModel {
    /// The name `--model` takes.
    pub fn name(self) -> &'static str {
        match self {
            CtrModel::Lr => "lr",
            CtrModel::Fm => "fm",
            CtrModel::Dlrm => "dlrm",
        }
    }
}

/// Sizes of a CTR model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CtrShape {
    /// The model.
    pub model: CtrModel,
    /// Embedding (FM: factor) dimension.
    pub embedding_dim: u32,
    /// Hidden units of the DLRM MLP.
    pub hidden: u32,
}

impl CtrShape {
    /// Floats per sparse row.
    pub fn row_dim(&self) -> usize {
        match self.model {
            CtrModel::Lr => 1,
            CtrModel::Fm => 1 + self.embedding_dim as usize,
            CtrModel::Dlrm => self.embedding_dim as usize,
        }
    }

    fn dlrm_input(&self) -> usize {
        NUM_INT + NUM_CAT * self.embedding_dim as usize
    }

    /// The model's layout: its dense tensors and its one sparse table.
    pub fn layout(&self, chunk_elems: u32) -> Result<Layout, LayoutError> {
        let t = |name: &str, shape: &[usize]| TensorSpec::with_shape(name, shape.iter().map(|d| *d as u64).collect());
        let (tensors, table) = match self.model {
            CtrModel::Lr => (vec![t("lr.int", &[NUM_INT]), t("lr.bias", &[1])], "lr.w"),
            CtrModel::Fm => (vec![t("fm.int", &[NUM_INT]), t("fm.bias", &[1])], "fm.v"),
            CtrModel::Dlrm => {
                let h = self.hidden as usize;
                // w1 is row-major [hidden, input]: row j holds hidden unit j's input weights.
                (
                    vec![
                        t("dlrm.w1", &[h, self.dlrm_input()]),
                        t("dlrm.b1", &[h]),
                        t("dlrm.w2", &[h]),
                        t("dlrm.b2", &[1]),
                    ],
                    "dlrm.emb",
                )
            }
        };
        Layout::with_tables(tensors, chunk_elems, vec![SparseSpec::new(table, self.row_dim() as u32)])
    }

    /// Recovers the shape from a cluster's layout (checking the names), or says what the cluster serves.
    pub fn from_layout(model: CtrModel, layout: &Layout) -> Result<CtrShape, String> {
        let served = || {
            format!(
                "tensors [{}] and tables [{}]",
                layout.tensors.iter().map(|t| t.name.as_str()).collect::<Vec<_>>().join(", "),
                layout.tables.iter().map(|t| t.name.as_str()).collect::<Vec<_>>().join(", ")
            )
        };
        let Some(table) = layout.tables.first() else {
            return Err(format!(
                "this worker trains --model {} (an embedding table and a dense network), but the cluster serves {}: start the worker with the model the shards' layout file describes",
                model.name(),
                served()
            ));
        };
        let shape = match model {
            CtrModel::Lr => CtrShape { model, embedding_dim: 1, hidden: 0 },
            CtrModel::Fm => CtrShape { model, embedding_dim: table.dim.saturating_sub(1), hidden: 0 },
            CtrModel::Dlrm => {
                CtrShape { model, embedding_dim: table.dim, hidden: layout.tensors.get(1).map_or(0, |t| t.len as u32) }
            }
        };
        match shape.layout(layout.chunk_elems) {
            Ok(expected) if expected.same_model(layout) => Ok(shape),
            _ => Err(format!(
                "this worker trains --model {}, but the cluster serves {}: start the worker with the model the shards' layout file describes",
                model.name(),
                served()
            )),
        }
    }
}

/// A batch's distinct feature ids and, per sample and field, the index of its id (or [`MISSING`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexedBatch {
    /// Distinct ids in first-seen order.
    pub ids: Vec<u64>,
    /// `samples × NUM_CAT` positions into `ids`.
    pub slots: Vec<u32>,
}

/// Indexes a batch (deduplicating its ids).
pub fn index_batch(samples: &[Sample]) -> IndexedBatch {
    let mut position: HashMap<u64, u32> = HashMap::with_capacity(samples.len() * 8);
    let mut ids = Vec::new();
    let mut slots = Vec::with_capacity(samples.len() * NUM_CAT);
    for s in samples {
        for f in 0..NUM_CAT {
            slots.push(match s.feature_id(f) {
                Some(id) => *position.entry(id).or_insert_with(|| {
                    ids.push(id);
                    (ids.len() - 1) as u32
                }),
                None => MISSING,
            });
        }
    }
    IndexedBatch { ids, slots }
}

pub fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// Logits of every sample; when `grads` is given, also accumulates the gradients of the mean log-loss
/// into `grads.0` (dense, layout order) and `grads.1` (`ids × row_dim`). Returns the summed log-loss.
pub fn forward(
    shape: &CtrShape,
    dense: &[Vec<f32>],
    rows: &[f32],
    batch: &IndexedBatch,
    samples: &[Sample],
    logits: &mut Vec<f32>,
    mut grads: Option<(&mut [Vec<f32>], &mut [f32])>,
) -> f32 {
    if shape.model == CtrModel::Dlrm {
        return dlrm_forward((shape, dense, rows), (batch, samples), logits, grads);
    }
    let d = shape.row_dim();
    let k = shape.embedding_dim as usize;
    let scale = 1.0 / samples.len().max(1) as f32;
    let mut loss = 0.0f32;
    logits.clear();
    let mut sums = vec![0.0f32; k];
    for (i, s) in samples.iter().enumerate() {
        let slots = &batch.slots[i * NUM_CAT..(i + 1) * NUM_CAT];
        let x: [f32; NUM_INT] = std::array::from_fn(|j| s.log_int(j));
        // Lr or Fm (DLRM is dlrm_forward).
        let logit = {
            let (w_int, bias) = (&dense[0], dense[1][0]);
            let mut logit = bias + x.iter().zip(w_int).map(|(x, w)| x * w).sum::<f32>();
            sums.iter_mut().for_each(|v| *v = 0.0);
            let mut squares = 0.0f32;
            for slot in slots.iter().filter(|s| **s != MISSING) {
                let row = &rows[*slot as usize * d..(*slot as usize + 1) * d];
                logit += row[0];
                if shape.model == CtrModel::Fm {
                    for (j, v) in row[1..].iter().enumerate() {
                        sums[j] += v;
                        squares += v * v;
                    }
                }
            }
            if shape.model == CtrModel::Fm {
                logit += 0.5 * (sums.iter().map(|v| v * v).sum::<f32>() - squares);
            }
            logit
        };
        logits.push(logit);
        let (sample_loss, dl) = log_loss(logit, s.label, scale);
        loss += sample_loss;
        let Some((gd, gr)) = grads.as_mut() else { continue };
        gd[0].iter_mut().zip(&x).for_each(|(g, x)| *g += dl * x);
        gd[1][0] += dl;
        for slot in slots.iter().filter(|s| **s != MISSING) {
            let base = *slot as usize * d;
            gr[base] += dl;
            if shape.model == CtrModel::Fm {
                for j in 0..k {
                    // ∂/∂v_fj of ½[(Σ v)² − Σ v²] = S_j − v_fj.
                    gr[base + 1 + j] += dl * (sums[j] - rows[base + 1 + j]);
                }
            }
        }
    }
    loss
}

/// A sample's log-loss at `logit` for `label`, and its gradient with respect to the logit times `scale`.
fn log_loss(logit: f32, label: u8, scale: f32) -> (f32, f32) {
    let p = sigmoid(logit).clamp(1e-7, 1.0 - 1e-7);
    let y = f32::from(label);
    (-(y * p.ln() + (1.0 - y) * (1.0 - p).ln()), (p - y) * scale)
}

/// `c = a · b (+ c when accumulate)` for row-major `a` (`m × k`, row stride `rsa`, column stride `csa`), `b`
/// (`k × n`, strides `rsb`, `csb`) and `c` (`m × n`, row-major): one call of `matrixmultiply`'s sgemm (its
/// kernels chosen for the CPU at run time).
fn gemm(
    m: usize,
    k: usize,
    n: usize,
    a: (&[f32], usize, usize),
    b: (&[f32], usize, usize),
    c: &mut [f32],
    accumulate: bool,
) {
    let ((a, rsa, csa), (b, rsb, csb)) = (a, b);
    let last = |rows: usize, cols: usize, rs: usize, cs: usize| {
        if rows == 0 || cols == 0 {
            0
        } else {
            (rows - 1) * rs + (cols - 1) * cs + 1
        }
    };
    // The bounds the unsafe call relies on, checked in every build: a wrong stride is a panic, never a read
    // or write outside the slices.
    assert!(
        a.len() >= last(m, k, rsa, csa) && b.len() >= last(k, n, rsb, csb) && c.len() >= m * n,
        "gemm: {m}×{k}×{n} does not fit its buffers"
    );
    if m == 0 || n == 0 {
        return;
    }
    let beta = if accumulate { 1.0 } else { 0.0 };
    #[allow(unsafe_code)]
    // SAFETY: every element sgemm reads (a[i·rsa + p·csa] for i < m, p < k; b[p·rsb + j·csb] for p < k,
    // j < n) and writes (c[i·n + j] for i < m, j < n) lies within its slice, as asserted above; `c` is a
    // unique borrow that overlaps neither `a` nor `b`; strides fit isize (they index slices that exist).
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            rsa as isize,
            csa as isize,
            b.as_ptr(),
            rsb as isize,
            csb as isize,
            beta,
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

/// [`forward`] of DLRM, the whole batch at once: the samples' inputs as the rows of one matrix `Z`
/// (`samples × input`: log integer features, then each field's embedding, zeros where missing), the hidden
/// layer as one product `Z · W1ᵀ`, and the backward pass as two more (`dW1 += dHᵀ · Z`, `dZ = dH · W1`) —
/// where sample by sample it was a matrix-vector product each, reading `W1` from the caches twice a sample.
/// The model is (shape, dense tensors, the batch's rows), the data (its index, its samples).
fn dlrm_forward(
    (shape, dense, rows): (&CtrShape, &[Vec<f32>], &[f32]),
    (batch, samples): (&IndexedBatch, &[Sample]),
    logits: &mut Vec<f32>,
    grads: Option<(&mut [Vec<f32>], &mut [f32])>,
) -> f32 {
    let (d, k, hidden) = (shape.row_dim(), shape.embedding_dim as usize, shape.hidden as usize);
    let (input, n) = (shape.dlrm_input(), samples.len());
    let scale = 1.0 / n.max(1) as f32;
    let (w1, b1, w2, b2) = (&dense[0], &dense[1], &dense[2], dense[3][0]);
    let mut z = vec![0.0f32; n * input];
    for (i, s) in samples.iter().enumerate() {
        let zi = &mut z[i * input..(i + 1) * input];
        for (j, v) in zi[..NUM_INT].iter_mut().enumerate() {
            *v = s.log_int(j);
        }
        for (f, slot) in batch.slots[i * NUM_CAT..(i + 1) * NUM_CAT].iter().enumerate() {
            if *slot != MISSING {
                let row = &rows[*slot as usize * d..*slot as usize * d + k];
                zi[NUM_INT + f * k..NUM_INT + (f + 1) * k].copy_from_slice(row);
            }
        }
    }
    // h = relu(Z · W1ᵀ + b1); W1 is row-major [hidden, input], so W1ᵀ has row stride 1, column stride input.
    let mut h = vec![0.0f32; n * hidden];
    gemm(n, input, hidden, (&z, input, 1), (w1, 1, input), &mut h, false);
    let mut dl = vec![0.0f32; n];
    let mut loss = 0.0f32;
    logits.clear();
    for (i, s) in samples.iter().enumerate() {
        let hi = &mut h[i * hidden..(i + 1) * hidden];
        hi.iter_mut().zip(b1.iter()).for_each(|(v, b)| *v = (*v + b).max(0.0));
        let logit = b2 + hi.iter().zip(w2.iter()).map(|(h, w)| h * w).sum::<f32>();
        logits.push(logit);
        let (sample_loss, g) = log_loss(logit, s.label, scale);
        loss += sample_loss;
        dl[i] = g;
    }
    let Some((gd, gr)) = grads else { return loss };
    // dH (samples × hidden): the logit's gradient through w2 and the ReLU.
    let mut dh = vec![0.0f32; n * hidden];
    for i in 0..n {
        gd[3][0] += dl[i];
        for u in 0..hidden {
            let hu = h[i * hidden + u];
            gd[2][u] += dl[i] * hu;
            if hu > 0.0 {
                let g = dl[i] * w2[u];
                dh[i * hidden + u] = g;
                gd[1][u] += g;
            }
        }
    }
    // dW1 += dHᵀ · Z (dHᵀ: row stride 1, column stride hidden); dZ = dH · W1.
    gemm(hidden, n, input, (&dh, 1, hidden), (&z, input, 1), &mut gd[0], true);
    let mut dz = z;
    gemm(n, hidden, input, (&dh, hidden, 1), (w1, input, 1), &mut dz, false);
    for (i, slots) in batch.slots.chunks_exact(NUM_CAT).take(n).enumerate() {
        for (f, slot) in slots.iter().enumerate() {
            if *slot != MISSING {
                let base = *slot as usize * d;
                let from = &dz[i * input + NUM_INT + f * k..i * input + NUM_INT + (f + 1) * k];
                gr[base..base + k].iter_mut().zip(from).for_each(|(g, v)| *g += v);
            }
        }
    }
    loss
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::criteo::SyntheticCriteo;

    type Setup = (CtrShape, Vec<Vec<f32>>, Vec<f32>, IndexedBatch, Vec<Sample>);

    fn setup(model: CtrModel) -> Setup {
        setup_shaped(CtrShape { model, embedding_dim: 3, hidden: 5 }, 6, (4, 2), 0.3)
    }

    /// Random weights (seed `seeds.0`, standard deviation `std`) and rows for `n` synthetic samples (seed
    /// `seeds.1`) of `shape`.
    fn setup_shaped(shape: CtrShape, n: u64, seeds: (u64, u64), std: f64) -> Setup {
        let layout = shape.layout(1 << 16).expect("layout");
        let mut rng = gaps_common::rng::Rng::new(seeds.0);
        let dense: Vec<Vec<f32>> =
            layout.tensors.iter().map(|t| (0..t.len).map(|_| (rng.normal() * std) as f32).collect()).collect();
        let data = SyntheticCriteo::new(seeds.1);
        let samples: Vec<Sample> = (0..n).map(|i| data.sample(i).0).collect();
        let batch = index_batch(&samples);
        let rows: Vec<f32> = (0..batch.ids.len() * shape.row_dim()).map(|_| (rng.normal() * std) as f32).collect();
        (shape, dense, rows, batch, samples)
    }

    #[test]
    fn gradients_match_finite_differences_for_every_model() {
        for model in [CtrModel::Lr, CtrModel::Fm, CtrModel::Dlrm] {
            let (shape, dense, rows, batch, samples) = setup(model);
            let mut gd: Vec<Vec<f32>> = dense.iter().map(|t| vec![0.0; t.len()]).collect();
            let mut gr = vec![0.0; rows.len()];
            let mut logits = Vec::new();
            forward(&shape, &dense, &rows, &batch, &samples, &mut logits, Some((&mut gd, &mut gr)));
            let loss = |dense: &[Vec<f32>], rows: &[f32]| {
                let mut l = Vec::new();
                forward(&shape, dense, rows, &batch, &samples, &mut l, None) as f64 / samples.len() as f64
            };
            let h = 1e-2f32;
            for (t, j) in [(0usize, 0usize), (0, 2), (1, 0)] {
                let (mut plus, mut minus) = (dense.clone(), dense.clone());
                plus[t][j] += h;
                minus[t][j] -= h;
                let numeric = (loss(&plus, &rows) - loss(&minus, &rows)) / (2.0 * f64::from(h));
                assert!(
                    (numeric - f64::from(gd[t][j])).abs() < 2e-3,
                    "{model:?} dense {t}/{j}: {numeric} vs {}",
                    gd[t][j]
                );
            }
            for q in [0usize, 1, rows.len() - 1] {
                let (mut plus, mut minus) = (rows.clone(), rows.clone());
                plus[q] += h;
                minus[q] -= h;
                let numeric = (loss(&dense, &plus) - loss(&dense, &minus)) / (2.0 * f64::from(h));
                assert!((numeric - f64::from(gr[q])).abs() < 2e-3, "{model:?} row value {q}: {numeric} vs {}", gr[q]);
            }
        }
    }

    #[test]
    fn batches_are_deduplicated_and_layouts_recognised() {
        let (shape, _, _, batch, samples) = setup(CtrModel::Dlrm);
        let mut seen = std::collections::HashSet::new();
        assert!(batch.ids.iter().all(|id| seen.insert(*id)), "ids are distinct");
        for (i, s) in samples.iter().enumerate() {
            for f in 0..NUM_CAT {
                let slot = batch.slots[i * NUM_CAT + f];
                assert_eq!(s.feature_id(f), (slot != MISSING).then(|| batch.ids[slot as usize]));
            }
        }
        let layout = shape.layout(1024).expect("layout");
        assert_eq!(CtrShape::from_layout(CtrModel::Dlrm, &layout), Ok(shape));
        assert!(CtrShape::from_layout(CtrModel::Fm, &layout).is_err());
    }

    /// The batched DLRM (three matrix products) against a plain sample-by-sample computation in f64
    /// written here: logits, loss and every gradient, dense and rows, at the default shape's proportions
    /// and with missing fields.
    #[test]
    fn batched_dlrm_agrees_with_a_sample_by_sample_reference() {
        let shape = CtrShape { model: CtrModel::Dlrm, embedding_dim: 4, hidden: 7 };
        let (shape, dense, rows, mut batch, samples) = setup_shaped(shape, 37, (11, 5), 0.2);
        batch.slots[3] = MISSING;
        batch.slots[NUM_CAT * 5 + 7] = MISSING;
        let d = shape.row_dim();
        // Gradients are added to what the buffers hold (a batch cut into parts adds up).
        let mut gd: Vec<Vec<f32>> = dense.iter().map(|t| vec![0.5; t.len()]).collect();
        let mut gr = vec![0.25; rows.len()];
        let mut logits = Vec::new();
        let loss = forward(&shape, &dense, &rows, &batch, &samples, &mut logits, Some((&mut gd, &mut gr)));
        gd.iter_mut().flatten().for_each(|g| *g -= 0.5);
        gr.iter_mut().for_each(|g| *g -= 0.25);

        let (k, hidden, input) = (4usize, 7usize, shape.dlrm_input());
        let mut want_gd: Vec<Vec<f64>> = dense.iter().map(|t| vec![0.0; t.len()]).collect();
        let mut want_gr = vec![0.0f64; rows.len()];
        let mut want_loss = 0.0f64;
        for (i, s) in samples.iter().enumerate() {
            let slots = &batch.slots[i * NUM_CAT..(i + 1) * NUM_CAT];
            let mut z = vec![0.0f64; input];
            for (j, v) in z.iter_mut().take(NUM_INT).enumerate() {
                *v = f64::from(s.log_int(j));
            }
            for (f, slot) in slots.iter().enumerate().filter(|(_, s)| **s != MISSING) {
                for j in 0..k {
                    z[NUM_INT + f * k + j] = f64::from(rows[*slot as usize * d + j]);
                }
            }
            let h: Vec<f64> = (0..hidden)
                .map(|u| {
                    let pre: f64 = (0..input).map(|q| f64::from(dense[0][u * input + q]) * z[q]).sum();
                    (pre + f64::from(dense[1][u])).max(0.0)
                })
                .collect();
            let logit = f64::from(dense[3][0]) + (0..hidden).map(|u| h[u] * f64::from(dense[2][u])).sum::<f64>();
            assert!((logit - f64::from(logits[i])).abs() < 1e-4, "sample {i}: logit {} against {logit}", logits[i]);
            let p = (1.0 / (1.0 + (-logit).exp())).clamp(1e-7, 1.0 - 1e-7);
            let y = f64::from(s.label);
            want_loss -= y * p.ln() + (1.0 - y) * (1.0 - p).ln();
            let dl = (p - y) / samples.len() as f64;
            want_gd[3][0] += dl;
            for u in 0..hidden {
                want_gd[2][u] += dl * h[u];
                if h[u] > 0.0 {
                    let dh = dl * f64::from(dense[2][u]);
                    want_gd[1][u] += dh;
                    for q in 0..input {
                        want_gd[0][u * input + q] += dh * z[q];
                    }
                    for (f, slot) in slots.iter().enumerate().filter(|(_, s)| **s != MISSING) {
                        for j in 0..k {
                            want_gr[*slot as usize * d + j] +=
                                dh * f64::from(dense[0][u * input + NUM_INT + f * k + j]);
                        }
                    }
                }
            }
        }
        assert!((want_loss - f64::from(loss)).abs() < 1e-3 * want_loss.max(1.0), "loss {loss} against {want_loss}");
        for (t, (got, want)) in gd.iter().zip(&want_gd).enumerate() {
            for (j, (g, w)) in got.iter().zip(want).enumerate() {
                assert!((f64::from(*g) - w).abs() < 1e-5, "dense {t}/{j}: {g} against {w}");
            }
        }
        for (q, (g, w)) in gr.iter().zip(&want_gr).enumerate() {
            assert!((f64::from(*g) - w).abs() < 1e-5, "row value {q}: {g} against {w}");
        }
        assert!(gr.iter().any(|g| *g != 0.0) && gd[0].iter().any(|g| *g != 0.0), "gradients reach rows and weights");
    }
}
