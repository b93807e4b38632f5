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
    let d = shape.row_dim();
    let k = shape.embedding_dim as usize;
    let scale = 1.0 / samples.len().max(1) as f32;
    let mut loss = 0.0f32;
    logits.clear();
    let hidden = shape.hidden as usize;
    let input_len = if shape.model == CtrModel::Dlrm { shape.dlrm_input() } else { 0 };
    let (mut z, mut h, mut dz) = (vec![0.0f32; input_len], vec![0.0f32; hidden], vec![0.0f32; input_len]);
    let mut sums = vec![0.0f32; k];
    for (i, s) in samples.iter().enumerate() {
        let slots = &batch.slots[i * NUM_CAT..(i + 1) * NUM_CAT];
        let x: [f32; NUM_INT] = std::array::from_fn(|j| s.log_int(j));
        let logit = match shape.model {
            CtrModel::Lr | CtrModel::Fm => {
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
            }
            CtrModel::Dlrm => {
                z[..NUM_INT].copy_from_slice(&x);
                for (f, slot) in slots.iter().enumerate() {
                    let dst = &mut z[NUM_INT + f * k..NUM_INT + (f + 1) * k];
                    if *slot == MISSING {
                        dst.iter_mut().for_each(|v| *v = 0.0);
                    } else {
                        dst.copy_from_slice(&rows[*slot as usize * d..(*slot as usize + 1) * d]);
                    }
                }
                let (w1, b1, w2, b2) = (&dense[0], &dense[1], &dense[2], dense[3][0]);
                for u in 0..hidden {
                    h[u] = (b1[u] + dot(&w1[u * input_len..(u + 1) * input_len], &z)).max(0.0);
                }
                b2 + h.iter().zip(w2.iter()).map(|(h, w)| h * w).sum::<f32>()
            }
        };
        logits.push(logit);
        let p = sigmoid(logit).clamp(1e-7, 1.0 - 1e-7);
        let y = f32::from(s.label);
        loss -= y * p.ln() + (1.0 - y) * (1.0 - p).ln();
        let Some((gd, gr)) = grads.as_mut() else { continue };
        let dl = (p - y) * scale;
        match shape.model {
            CtrModel::Lr | CtrModel::Fm => {
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
            CtrModel::Dlrm => {
                let (w1, w2) = (&dense[0], &dense[2]);
                gd[3][0] += dl;
                dz.iter_mut().for_each(|v| *v = 0.0);
                for u in 0..hidden {
                    gd[2][u] += dl * h[u];
                    if h[u] <= 0.0 {
                        continue;
                    }
                    let dh = dl * w2[u];
                    gd[1][u] += dh;
                    let row = &w1[u * input_len..(u + 1) * input_len];
                    let grow = &mut gd[0][u * input_len..(u + 1) * input_len];
                    for q in 0..input_len {
                        grow[q] += dh * z[q];
                        dz[q] += dh * row[q];
                    }
                }
                for (f, slot) in slots.iter().enumerate() {
                    if *slot != MISSING {
                        let base = *slot as usize * d;
                        gr[base..base + k]
                            .iter_mut()
                            .zip(&dz[NUM_INT + f * k..NUM_INT + (f + 1) * k])
                            .for_each(|(g, v)| *g += v);
                    }
                }
            }
        }
    }
    loss
}

/// The dot product of `a` and `b` (as long as the shorter), summed in 16 independent lanes so that the
/// compiler vectorizes it (a single running sum is one dependent addition after another: a quarter of the
/// speed or less).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 16;
    let n = a.len().min(b.len());
    let (a, b) = (a[..n].chunks_exact(LANES), b[..n].chunks_exact(LANES));
    let tail: f32 = a.remainder().iter().zip(b.remainder()).map(|(x, y)| x * y).sum();
    let mut acc = [0.0f32; LANES];
    for (x, y) in a.zip(b) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::criteo::SyntheticCriteo;

    fn setup(model: CtrModel) -> (CtrShape, Vec<Vec<f32>>, Vec<f32>, IndexedBatch, Vec<Sample>) {
        let shape = CtrShape { model, embedding_dim: 3, hidden: 5 };
        let layout = shape.layout(1 << 16).expect("layout");
        let mut rng = gaps_common::rng::Rng::new(4);
        let dense: Vec<Vec<f32>> =
            layout.tensors.iter().map(|t| (0..t.len).map(|_| rng.normal() as f32 * 0.3).collect()).collect();
        let data = SyntheticCriteo::new(2);
        let samples: Vec<Sample> = (0..6).map(|i| data.sample(i).0).collect();
        let batch = index_batch(&samples);
        let rows: Vec<f32> = (0..batch.ids.len() * shape.row_dim()).map(|_| rng.normal() as f32 * 0.3).collect();
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

    #[test]
    fn dot_products_agree_with_a_plain_sum_at_every_length() {
        let mut rng = gaps_common::rng::Rng::new(9);
        for n in 0..70 {
            let a: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
            let b: Vec<f32> = (0..n + 3).map(|_| rng.normal() as f32).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
            let got = dot(&a, &b);
            assert!((f64::from(got) - want).abs() <= 1e-5 * (1.0 + want.abs()), "n {n}: {got} against {want}");
            // Small integers sum exactly in any order.
            let ints: Vec<f32> = (0..n).map(|i| (i % 7) as f32 - 3.0).collect();
            let exact: f32 = ints.iter().map(|x| x * x).sum();
            assert_eq!(dot(&ints, &ints), exact, "n {n}");
        }
    }
}
