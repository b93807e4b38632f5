//! Dense tensor layout: chunking and the chunk → shard partition.
//!
//! Every dense tensor of `len` elements is cut into chunks of `chunk_elems` elements (the last chunk may be
//! shorter). Chunks are numbered globally in tensor order; chunk `g` lives on shard `g % num_shards`. The
//! rule is stable and documented so that workers compute routes locally from the cluster map.

use bincode::{Decode, Encode};
use std::ops::Range;

/// Update-rule settings of one tensor or table that differ from the shard's flags (`--rule`, `--lr`, …
/// for dense tensors; `--sparse-rule`, `--sparse-lr` for tables). Unset fields come from the flags. The
/// rule is a name as `--rule` takes it; the shard checks it when it starts.
#[derive(Debug, Clone, Default, PartialEq, Encode, Decode)]
pub struct RuleOverride {
    /// Update rule name, e.g. `momentum`, `adagrad`, `gap-aware`.
    pub rule: Option<String>,
    /// Learning rate η.
    pub lr: Option<f32>,
    /// Momentum γ.
    pub momentum: Option<f32>,
    /// L2 weight decay.
    pub weight_decay: Option<f32>,
    /// DC-ASGD / DANA-DC λ, or λ0 of dc-asgd-adaptive.
    pub dc_lambda: Option<f32>,
    /// Decay of dc-asgd-adaptive's mean square.
    pub dc_ms_decay: Option<f32>,
}

impl RuleOverride {
    /// True when nothing is overridden.
    pub fn is_empty(&self) -> bool {
        *self == RuleOverride::default()
    }
}

/// One dense tensor of the model.
#[derive(Debug, Clone, PartialEq, Encode, Decode)]
pub struct TensorSpec {
    /// Human-readable name, e.g. `logreg.w`.
    pub name: String,
    /// Number of f32 elements (the product of `shape`).
    pub len: u64,
    /// The tensor's shape, row-major (one dimension `[len]` for a flat tensor).
    pub shape: Vec<u64>,
    /// How this tensor is updated, where it differs from the shard's flags.
    pub rule: RuleOverride,
    /// How its gradients and values travel (None: the shard's `--wire-dtype`). A transport setting, not
    /// part of the model: it is left out of [`Layout::fingerprint`], and shards with different settings
    /// still understand each other (every chunk on the wire names its format).
    pub wire_dtype: Option<crate::dtype::WireDtype>,
}

impl TensorSpec {
    /// A flat tensor of `len` elements updated with the shard's rule.
    pub fn new(name: impl Into<String>, len: u64) -> Self {
        TensorSpec { name: name.into(), len, shape: vec![len], rule: RuleOverride::default(), wire_dtype: None }
    }

    /// A tensor of the given shape updated with the shard's rule.
    pub fn with_shape(name: impl Into<String>, shape: Vec<u64>) -> Self {
        let len = shape.iter().try_fold(1u64, |a, d| a.checked_mul(*d)).unwrap_or(u64::MAX);
        TensorSpec { name: name.into(), len, shape, rule: RuleOverride::default(), wire_dtype: None }
    }
}

/// Identifies one chunk of one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Encode, Decode)]
pub struct ChunkId {
    /// Index of the tensor in [`Layout::tensors`].
    pub tensor: u32,
    /// Index of the chunk inside the tensor.
    pub chunk: u32,
}

/// Errors about a layout or a chunk reference.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// The layout itself is unusable.
    #[error("invalid layout: {0}")]
    Invalid(String),
    /// A chunk reference names a tensor or chunk that does not exist.
    #[error("unknown chunk {tensor}/{chunk}")]
    UnknownChunk {
        /// Tensor index.
        tensor: u32,
        /// Chunk index.
        chunk: u32,
    },
}

/// One sparse embedding table of the model: u64 feature ids → rows of `dim` floats. Row `id` of table `t`
/// lives on shard [`sparse_owner`]`(t, id, num_shards)`.
#[derive(Debug, Clone, PartialEq, Encode, Decode)]
pub struct SparseSpec {
    /// Human-readable name, e.g. `dlrm.emb`.
    pub name: String,
    /// Floats per row.
    pub dim: u32,
    /// How the rows are updated, where it differs from the shard's sparse flags.
    pub rule: RuleOverride,
}

impl SparseSpec {
    /// A table of rows of `dim` floats updated with the shard's sparse rule.
    pub fn new(name: impl Into<String>, dim: u32) -> Self {
        SparseSpec { name: name.into(), dim, rule: RuleOverride::default() }
    }
}

/// The shard holding row `id` of table `table`: a stable 64-bit mix of (id, table) modulo the shard count.
pub fn sparse_owner(table: u32, id: u64, num_shards: u32) -> u32 {
    (crate::rng::mix(id, 0x5ba2_5e00 + u64::from(table)) % u64::from(num_shards.max(1))) as u32
}

/// The model's dense tensors, the chunk size and the sparse tables. Identical on every process of a
/// cluster (checked by [`Layout::fingerprint`]).
#[derive(Debug, Clone, PartialEq, Encode, Decode)]
pub struct Layout {
    /// The dense tensors, in order.
    pub tensors: Vec<TensorSpec>,
    /// Elements per chunk (the last chunk of a tensor may be shorter).
    pub chunk_elems: u32,
    /// The sparse embedding tables, in order (table index = position).
    pub tables: Vec<SparseSpec>,
}

/// Upper bound on the number of elements of one tensor (2^34 floats = 64 GiB), so sizes never overflow.
pub const MAX_TENSOR_ELEMS: u64 = 1 << 34;
/// Upper bound on the number of tensors in a layout.
pub const MAX_TENSORS: usize = 1 << 16;

impl Layout {
    /// Builds and validates a layout.
    pub fn new(tensors: Vec<TensorSpec>, chunk_elems: u32) -> Result<Self, LayoutError> {
        Layout::with_tables(tensors, chunk_elems, Vec::new())
    }

    /// Builds and validates a layout with sparse tables.
    pub fn with_tables(
        tensors: Vec<TensorSpec>,
        chunk_elems: u32,
        tables: Vec<SparseSpec>,
    ) -> Result<Self, LayoutError> {
        let layout = Layout { tensors, chunk_elems, tables };
        layout.validate()?;
        Ok(layout)
    }

    /// Checks every bound; a layout received from the network goes through this before use.
    pub fn validate(&self) -> Result<(), LayoutError> {
        if self.chunk_elems == 0 {
            return Err(LayoutError::Invalid("chunk_elems must be at least 1".into()));
        }
        if self.tensors.is_empty() {
            return Err(LayoutError::Invalid("the model has no tensors".into()));
        }
        if self.tensors.len() > MAX_TENSORS {
            return Err(LayoutError::Invalid(format!("more than {MAX_TENSORS} tensors")));
        }
        let mut total_chunks: u64 = 0;
        for t in &self.tensors {
            if t.len == 0 || t.len > MAX_TENSOR_ELEMS {
                return Err(LayoutError::Invalid(format!(
                    "tensor {:?} has {} elements (must be 1..={MAX_TENSOR_ELEMS})",
                    t.name, t.len
                )));
            }
            let product = t.shape.iter().try_fold(1u64, |a, d| a.checked_mul(*d));
            if t.shape.is_empty() || t.shape.len() > 8 || product != Some(t.len) {
                return Err(LayoutError::Invalid(format!(
                    "tensor {:?} has shape {:?} but {} elements (1 to 8 dimensions whose product is the length)",
                    t.name, t.shape, t.len
                )));
            }
            total_chunks += t.len.div_ceil(u64::from(self.chunk_elems));
        }
        if total_chunks > u64::from(u32::MAX) {
            return Err(LayoutError::Invalid("more than 2^32 chunks".into()));
        }
        let names = self.tensors.iter().map(|t| &t.name).chain(self.tables.iter().map(|t| &t.name));
        let mut seen = std::collections::HashSet::new();
        for name in names {
            if name.is_empty() || name.len() > 256 {
                return Err(LayoutError::Invalid(format!("name {name:?} must have 1 to 256 bytes")));
            }
            if !seen.insert(name) {
                return Err(LayoutError::Invalid(format!("two tensors or tables are named {name:?}")));
            }
        }
        let overrides =
            self.tensors.iter().map(|t| (&t.name, &t.rule)).chain(self.tables.iter().map(|t| (&t.name, &t.rule)));
        for (name, o) in overrides {
            let values = [o.lr, o.momentum, o.weight_decay, o.dc_lambda, o.dc_ms_decay];
            if values.iter().flatten().any(|v| !v.is_finite()) {
                return Err(LayoutError::Invalid(format!("{name:?} has a non-finite hyper-parameter")));
            }
        }
        if self.tables.len() > 1024 {
            return Err(LayoutError::Invalid("more than 1024 sparse tables".into()));
        }
        if let Some(t) = self.tables.iter().find(|t| t.dim == 0 || t.dim > 4096) {
            return Err(LayoutError::Invalid(format!("table {:?} has dim {} (must be 1..=4096)", t.name, t.dim)));
        }
        Ok(())
    }

    /// Number of chunks of tensor `tensor` (0 when the tensor does not exist).
    pub fn num_chunks(&self, tensor: u32) -> u32 {
        self.tensors.get(tensor as usize).map_or(0, |t| t.len.div_ceil(u64::from(self.chunk_elems)) as u32)
    }

    /// Total number of chunks over all tensors.
    pub fn total_chunks(&self) -> u64 {
        (0..self.tensors.len() as u32).map(|t| u64::from(self.num_chunks(t))).sum()
    }

    /// Total number of elements over all tensors.
    pub fn total_elems(&self) -> u64 {
        self.tensors.iter().map(|t| t.len).sum()
    }

    /// Element range of a chunk inside its tensor.
    pub fn chunk_range(&self, id: ChunkId) -> Result<Range<usize>, LayoutError> {
        let t = self
            .tensors
            .get(id.tensor as usize)
            .ok_or(LayoutError::UnknownChunk { tensor: id.tensor, chunk: id.chunk })?;
        let start = u64::from(id.chunk) * u64::from(self.chunk_elems);
        if start >= t.len {
            return Err(LayoutError::UnknownChunk { tensor: id.tensor, chunk: id.chunk });
        }
        let end = (start + u64::from(self.chunk_elems)).min(t.len);
        Ok(start as usize..end as usize)
    }

    /// Number of elements of a chunk.
    pub fn chunk_len(&self, id: ChunkId) -> Result<usize, LayoutError> {
        self.chunk_range(id).map(|r| r.len())
    }

    /// Global index of a chunk (tensor order, then chunk order).
    pub fn global_index(&self, id: ChunkId) -> Result<u64, LayoutError> {
        self.chunk_range(id)?;
        let before: u64 = (0..id.tensor).map(|t| u64::from(self.num_chunks(t))).sum();
        Ok(before + u64::from(id.chunk))
    }

    /// The shard that owns a chunk: `global_index % num_shards`.
    pub fn owner(&self, id: ChunkId, num_shards: u32) -> Result<u32, LayoutError> {
        Ok((self.global_index(id)? % u64::from(num_shards.max(1))) as u32)
    }

    /// Every chunk of the model, in global order.
    pub fn chunks(&self) -> impl Iterator<Item = ChunkId> + '_ {
        (0..self.tensors.len() as u32)
            .flat_map(move |tensor| (0..self.num_chunks(tensor)).map(move |chunk| ChunkId { tensor, chunk }))
    }

    /// The chunks owned by `shard`, in global order.
    pub fn chunks_of_shard(&self, shard: u32, num_shards: u32) -> Vec<ChunkId> {
        let n = u64::from(num_shards.max(1));
        self.chunks().enumerate().filter(|(g, _)| *g as u64 % n == u64::from(shard)).map(|(_, id)| id).collect()
    }

    /// A stable 64-bit fingerprint (FNV-1a over the layout's wire encoding: names, shapes, chunking, tables
    /// and rule overrides), used to detect processes configured with different models.
    pub fn fingerprint(&self) -> u64 {
        let mut model = self.clone();
        model.tensors.iter_mut().for_each(|t| t.wire_dtype = None);
        // (Kept in step with `same_model`.)
        let bytes = bincode::encode_to_vec(&model, bincode::config::standard()).unwrap_or_default();
        bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3))
    }

    /// True when `other` describes the same model: equal in everything but the tensors' wire formats.
    pub fn same_model(&self, other: &Layout) -> bool {
        let strip = |l: &Layout| {
            let mut l = l.clone();
            l.tensors.iter_mut().for_each(|t| t.wire_dtype = None);
            l
        };
        self.tensors.len() == other.tensors.len() && strip(self) == strip(other)
    }

    /// Gives every tensor without a wire format of its own `default` (a shard's `--wire-dtype`).
    pub fn resolve_wire_dtype(&mut self, default: crate::dtype::WireDtype) {
        self.tensors.iter_mut().for_each(|t| {
            t.wire_dtype.get_or_insert(default);
        });
    }

    /// The wire format of tensor `t` (f32 when unset or out of range).
    pub fn wire_dtype(&self, t: u32) -> crate::dtype::WireDtype {
        self.tensors.get(t as usize).and_then(|t| t.wire_dtype).unwrap_or_default()
    }

    /// Index of the tensor named `name`.
    pub fn tensor_index(&self, name: &str) -> Option<u32> {
        self.tensors.iter().position(|t| t.name == name).map(|i| i as u32)
    }

    /// Index of the table named `name`.
    pub fn table_index(&self, name: &str) -> Option<u32> {
        self.tables.iter().position(|t| t.name == name).map(|i| i as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Layout {
        Layout::new(vec![TensorSpec::new("a", 10), TensorSpec::new("b", 1), TensorSpec::new("c", 8)], 4)
            .expect("valid layout")
    }

    #[test]
    fn chunks_cover_every_element_once_and_spread_over_shards() {
        let l = layout();
        assert_eq!(l.total_chunks(), 3 + 1 + 2);
        let mut covered = [vec![0u8; 10], vec![0u8; 1], vec![0u8; 8]];
        for id in l.chunks() {
            for i in l.chunk_range(id).expect("chunk exists") {
                covered[id.tensor as usize][i] += 1;
            }
        }
        assert!(covered.iter().flatten().all(|c| *c == 1));
        let s0 = l.chunks_of_shard(0, 2);
        let s1 = l.chunks_of_shard(1, 2);
        assert_eq!(s0.len() + s1.len(), 6);
        assert_eq!(s0.len(), 3);
        for id in &s1 {
            assert_eq!(l.owner(*id, 2).expect("owner"), 1);
        }
        assert_eq!(l.chunk_len(ChunkId { tensor: 0, chunk: 2 }).expect("len"), 2);
    }

    #[test]
    fn bad_references_and_layouts_are_errors() {
        let l = layout();
        assert!(l.chunk_range(ChunkId { tensor: 0, chunk: 3 }).is_err());
        assert!(l.chunk_range(ChunkId { tensor: 9, chunk: 0 }).is_err());
        assert!(Layout::new(vec![], 4).is_err());
        assert!(Layout::new(vec![TensorSpec::new("x", 0)], 4).is_err());
        assert!(Layout::new(vec![TensorSpec::new("x", 3)], 0).is_err());
        let mut other = l.clone();
        other.tensors[2].len = 9;
        assert_ne!(l.fingerprint(), other.fingerprint());
        let mut with_table = l.clone();
        with_table.tables.push(SparseSpec::new("emb", 8));
        assert_ne!(l.fingerprint(), with_table.fingerprint());
        with_table.tables[0].dim = 0;
        assert!(with_table.validate().is_err());
        let counts = (0..10_000u64).fold([0u32; 3], |mut c, id| {
            c[sparse_owner(1, id, 3) as usize] += 1;
            c
        });
        assert!(counts.iter().all(|c| (3000..3700).contains(c)), "rows spread over shards: {counts:?}");
    }
}
