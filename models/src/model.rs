//! Models the worker trains. The layout of each model (its dense tensors) is defined here and used by
//! both the servers (to allocate) and the workers (to check the cluster map).

use gaps_common::layout::{Layout, LayoutError, TensorSpec};

/// The built-in models.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelKind {
    /// Dense logistic regression on the synthetic `--dim` features: tensors `logreg.w` (dim) and `logreg.b` (1).
    Logreg,
    /// Click-through logistic regression on Criteo-layout data (a sparse weight per feature id).
    Lr,
    /// Factorization machine on Criteo-layout data.
    Fm,
    /// DLRM-style model on Criteo-layout data.
    Dlrm,
}

gaps_common::named_variants!(ModelKind, "model", String, |m: String| m, {
    Logreg => "logreg",
    Lr => "lr",
    Fm => "fm",
    Dlrm => "dlrm",
});

/// The sizes that pick a model's layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelSize {
    /// Features of `logreg`.
    pub dim: u64,
    /// Embedding (FM: factor) dimension of the CTR models.
    pub embedding_dim: u32,
    /// Hidden units of `dlrm`.
    pub hidden: u32,
}

impl ModelKind {
    /// The CTR model this is, if any.
    pub fn ctr(self) -> Option<crate::recsys::CtrModel> {
        match self {
            ModelKind::Logreg => None,
            ModelKind::Lr => Some(crate::recsys::CtrModel::Lr),
            ModelKind::Fm => Some(crate::recsys::CtrModel::Fm),
            ModelKind::Dlrm => Some(crate::recsys::CtrModel::Dlrm),
        }
    }

    /// The layout (dense tensors and sparse tables) of this model.
    pub fn layout(self, size: &ModelSize, chunk_elems: u32) -> Result<Layout, LayoutError> {
        match self.ctr() {
            Some(model) => crate::recsys::CtrShape { model, embedding_dim: size.embedding_dim, hidden: size.hidden }
                .layout(chunk_elems),
            None => {
                Layout::new(vec![TensorSpec::new("logreg.w", size.dim), TensorSpec::new("logreg.b", 1)], chunk_elems)
            }
        }
    }

    /// Recovers the feature dimension from a cluster's layout, checking the tensor names.
    pub fn dim_from_layout(self, layout: &Layout) -> Result<u64, String> {
        match self {
            ModelKind::Logreg => match layout.tensors.as_slice() {
                [w, b] if w.name == "logreg.w" && b.name == "logreg.b" && b.len == 1 => Ok(w.len),
                _ => Err(format!(
                    "this worker trains --model logreg, but the cluster serves tensors [{}]: start the worker with the model the shards' layout file describes",
                    layout.tensors.iter().map(|t| t.name.as_str()).collect::<Vec<_>>().join(", ")
                )),
            },
            _ => Err(format!("{} is a CTR model; use recsys::CtrShape::from_layout", self.name())),
        }
    }
}

fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// Binary log-loss of probability `p` for label `y`, clamped away from log(0).
fn logloss(p: f32, y: f32) -> f32 {
    let p = p.clamp(1e-7, 1.0 - 1e-7);
    -(y * p.ln() + (1.0 - y) * (1.0 - p).ln())
}

/// Mean log-loss of logistic regression `params = [w, b]` on a row-major batch.
pub fn logreg_loss(params: &[Vec<f32>], xs: &[f32], labels: &[f32]) -> f32 {
    let (w, b) = (&params[0], params[1][0]);
    let dim = w.len();
    let total: f32 = labels
        .iter()
        .enumerate()
        .map(|(i, y)| {
            let z = b + xs[i * dim..(i + 1) * dim].iter().zip(w).map(|(x, w)| x * w).sum::<f32>();
            logloss(sigmoid(z), *y)
        })
        .sum();
    total / labels.len().max(1) as f32
}

/// Mean log-loss and its gradient (`[dw, db]`) for logistic regression on a row-major batch.
pub fn logreg_loss_and_grad(params: &[Vec<f32>], xs: &[f32], labels: &[f32]) -> (f32, Vec<Vec<f32>>) {
    let (w, b) = (&params[0], params[1][0]);
    let dim = w.len();
    let n = labels.len().max(1) as f32;
    let mut dw = vec![0.0f32; dim];
    let mut db = 0.0f32;
    let mut loss = 0.0f32;
    for (i, y) in labels.iter().enumerate() {
        let x = &xs[i * dim..(i + 1) * dim];
        let z = b + x.iter().zip(w).map(|(x, w)| x * w).sum::<f32>();
        let p = sigmoid(z);
        loss += logloss(p, *y);
        let r = (p - y) / n;
        dw.iter_mut().zip(x).for_each(|(d, x)| *d += r * x);
        db += r;
    }
    (loss / n, vec![dw, vec![db]])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gradient_matches_finite_differences() {
        let data = crate::data::SyntheticLogreg::new(5, 1);
        let (xs, ys) = data.batch(0, 8);
        let params = vec![vec![0.3, -0.2, 0.1, 0.0, 0.5], vec![0.05]];
        let (_, grad) = logreg_loss_and_grad(&params, &xs, &ys);
        let h = 1e-3;
        for (t, j) in [(0usize, 0usize), (0, 4), (1, 0)] {
            let mut plus = params.clone();
            plus[t][j] += h;
            let mut minus = params.clone();
            minus[t][j] -= h;
            let numeric = (logreg_loss(&plus, &xs, &ys) - logreg_loss(&minus, &xs, &ys)) / (2.0 * h);
            assert!((numeric - grad[t][j]).abs() < 2e-3, "{t}/{j}: {numeric} vs {}", grad[t][j]);
        }
        let size = ModelSize { dim: 5, embedding_dim: 4, hidden: 8 };
        let layout = ModelKind::Logreg.layout(&size, 2).expect("layout");
        assert_eq!(ModelKind::Logreg.dim_from_layout(&layout), Ok(5));
        assert!("dlrm9".parse::<ModelKind>().is_err());
    }
}
