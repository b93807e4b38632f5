//! What a shard core is made with: its configuration, the initializer and the sparse tables' settings.

use super::*;

/// How the shard initialises its parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Init {
    /// Seed of the initializer (each chunk draws from its own stream, so the value of a parameter does
    /// not depend on the number of shards).
    pub seed: u64,
    /// Standard deviation of the normal initializer; 0 gives zeros.
    pub std: f32,
}

impl Init {
    /// The initial values of the chunk with global index `global` (chunks numbered over all tensors in
    /// layout order), `len` elements.
    pub fn chunk(&self, global: u64, len: usize) -> Vec<f32> {
        if self.std == 0.0 {
            return vec![0.0; len];
        }
        let mut rng = Rng::new(mix(self.seed, global));
        (0..len).map(|_| (rng.normal() * f64::from(self.std)) as f32).collect()
    }

    /// The initial values of every dense tensor of `layout`, as the shards that hold it start them (a
    /// single-process trainer starting where a cluster starts).
    pub fn tensors(&self, layout: &Layout) -> Result<Vec<Vec<f32>>, gaps_common::layout::LayoutError> {
        let mut out: Vec<Vec<f32>> = layout.tensors.iter().map(|t| Vec::with_capacity(t.len as usize)).collect();
        for (global, id) in layout.chunks().enumerate() {
            let len = layout.chunk_range(id)?.len();
            out[id.tensor as usize].extend(self.chunk(global as u64, len));
        }
        Ok(out)
    }
}

/// How the shard keeps its sparse embedding tables.
#[derive(Debug, Clone, PartialEq)]
pub struct SparseSettings {
    /// Update rule of embedding rows (no per-worker state, no look-ahead); a table's `rule` in the layout
    /// takes precedence.
    pub rule: Rule,
    /// Its hyper-parameters (learning rate and so on; a table's overrides in the layout take precedence).
    pub hyper: Hyper,
    /// Standard deviation of the rows' normal initializer.
    pub init_std: f32,
    /// Adagrad's accumulator of a new row.
    pub adagrad_init: f32,
    /// Create a row only after its id was seen this many times.
    pub admit_after: u32,
    /// Memory budget of all tables of this shard together, bytes (split evenly over the tables).
    pub memory_budget: Option<u64>,
    /// Eviction policy.
    pub eviction: Eviction,
}

impl Default for SparseSettings {
    fn default() -> Self {
        SparseSettings {
            rule: Rule::Adagrad,
            hyper: Hyper { lr: 0.05, momentum: 0.0, ..Hyper::default() },
            init_std: 0.01,
            adagrad_init: 0.0,
            admit_after: 0,
            memory_budget: None,
            eviction: Eviction::Lru,
        }
    }
}

/// Static configuration of one shard.
#[derive(Debug, Clone)]
pub struct ShardConfig {
    /// This shard's index.
    pub shard: u32,
    /// Number of shards in the cluster.
    pub num_shards: u32,
    /// The model's dense tensors.
    pub layout: Layout,
    /// The update rule of dense tensors (a tensor's `rule` in the layout takes precedence).
    pub rule: Rule,
    /// Its hyper-parameters (a tensor's overrides in the layout take precedence).
    pub hyper: Hyper,
    /// Parameter initializer.
    pub init: Init,
    /// Worker lease (coordinator only): a worker silent this long is dropped from the live set.
    pub lease: Duration,
    /// This shard's address as clients should use it (reported in the cluster map).
    pub advertise: String,
    /// Cluster epoch (coordinator only; other shards learn it when they join).
    pub epoch: u64,
    /// Threads a large push may use (0: one per available core).
    pub threads: usize,
    /// Sparse tables (the layout lists them).
    pub sparse: SparseSettings,
    /// Training mode and its policies.
    pub modes: ModeConfig,
}

impl ShardConfig {
    /// Shard 0 of a one-shard cluster serving `layout`: plain SGD at the kernels' default hyper-parameters
    /// (η 0.1), parameters initialized to zero (seed 0), a 10 s worker lease, cluster epoch 1, one thread
    /// per push, no advertised address, default sparse settings and the default mode (async). Every field
    /// is public: set the ones that matter with `ShardConfig { rule: …, ..ShardConfig::new(layout) }`.
    pub fn new(layout: Layout) -> Self {
        ShardConfig {
            shard: 0,
            num_shards: 1,
            layout,
            rule: Rule::Sgd,
            hyper: Hyper::default(),
            init: Init { seed: 0, std: 0.0 },
            lease: Duration::from_secs(10),
            advertise: String::new(),
            epoch: 1,
            threads: 1,
            sparse: SparseSettings::default(),
            modes: ModeConfig::default(),
        }
    }
}
