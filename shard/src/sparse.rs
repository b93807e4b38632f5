//! Sparse embedding tables: u64 feature id → a row of `dim` f32 plus the rule's optimizer state and a
//! per-row version, created on first touch by a seeded initializer, with an optional admission filter and
//! eviction (LRU or TTL) under a memory budget.
//!
//! Memory layout (chosen for the index-overhead target of ≤ 32 bytes per row beyond the row data):
//! - rows live densely in one arena (`data`, `stride` floats per row: the values, then each state plane);
//! - per row: its id (8 bytes), version (4), last touch (4), together in one array (`RowMeta`);
//! - the index is open addressing with linear probing over `u32` slots (4 bytes per slot, load ≤ 0.8): a
//!   slot holds the row number in its low bits and, in the high bits a row number does not need (8 of them
//!   at 10 M rows), a tag of the id's hash, so a probe passes over other ids' slots without reading their
//!   ids (a miss each); a tag that matches is confirmed against the id array. Deletions shift entries
//!   back (no tombstones).
//!
//! Sans-IO like the rest of the core: time is an argument (`now_s`, seconds of any monotonic origin).

use gaps_common::buffers::{advise_huge_pages, filled_huge, prefetch, reserve_advised, reserve_huge};
use gaps_common::rng::{mix, Rng};
use gaps_kernels::{Bufs, Hyper, KernelError, PushScalars, Rule};

mod batch;

const EMPTY: u32 = u32::MAX;
/// How many ids ahead a batch lookup fetches what it reads ([`SparseTable::locate`]).
const AHEAD: usize = 16;
/// How many rows ahead a push's update pass fetches the rows it writes ([`SparseTable::push`]): 8, where 16
/// (right for the passes that only read) measured 1.3–1.5× slower per row on an AMD EPYC (10 M rows,
/// 2026-11-30; 4, 6, 8, 10, 12, 16 and 32 tried, 6–10 alike).
const PUSH_AHEAD: usize = 8;
/// Bytes of per-row metadata beside the row data: id (8), version (4), last touch (4).
pub const META_BYTES_PER_ROW: u64 = 16;

/// How rows leave a table that is over its memory budget (or idle too long).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Eviction {
    /// Approximately least recently used: the oldest of 8 sampled rows goes first.
    Lru,
    /// Rows untouched for `ttl_s` seconds are removed on `tick`; the budget is still enforced by LRU.
    Ttl {
        /// Seconds without a touch before a row expires.
        ttl_s: u32,
    },
}

/// Configuration of one table.
#[derive(Debug, Clone, PartialEq)]
pub struct TableConfig {
    /// Table number (part of the initializer's stream, so a row's initial value does not depend on the shard).
    pub table: u32,
    /// Floats per row.
    pub dim: u32,
    /// Update rule; must have no per-worker planes and no look-ahead.
    pub rule: Rule,
    /// Standard deviation of the normal initializer.
    pub init_std: f32,
    /// Adagrad: the accumulator a new row starts with (0 gives a rarely seen row a full-η first step
    /// whatever its gradient; TensorFlow's default is 0.1). Ignored by other rules.
    pub adagrad_init: f32,
    /// Initializer seed.
    pub seed: u64,
    /// A row is created only after its id was seen this many times (0 or 1: at once).
    pub admit_after: u32,
    /// Memory budget in bytes (row data, metadata and index); None = unbounded.
    pub memory_budget: Option<u64>,
    /// Eviction policy.
    pub eviction: Eviction,
}

/// Why a table cannot be used as configured.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("sparse table: {0}")]
pub struct TableError(pub String);

/// Slots of a new table's index.
const INITIAL_INDEX_SLOTS: usize = 1024;
/// A table's memory budget must hold at least this many rows.
pub const MIN_ROWS_IN_BUDGET: u64 = 1024;

/// Largest `admit_after` the sketch can count to (its counters are 8-bit).
pub const MAX_ADMIT_AFTER: u32 = u8::MAX as u32;

/// A count-min sketch of how often ids were seen recently (4 rows of 2^20 saturating 8-bit counters,
/// 4 MiB). Every [`Sightings::AGE_PERIOD`] sightings all counters are halved, so the sketch counts the
/// recent past (as TinyLFU does): over a week-long job an id must keep being seen to be admitted, and old
/// traffic cannot saturate the counters.
#[derive(Debug, Clone)]
struct Sightings {
    counters: Vec<u8>,
    since_aging: u64,
}

impl Sightings {
    const WIDTH_BITS: u32 = 20;
    /// Sightings between two halvings: 8 per counter of a row.
    const AGE_PERIOD: u64 = 8 << Self::WIDTH_BITS;

    fn new() -> Self {
        Sightings { counters: vec![0; 4 << Self::WIDTH_BITS], since_aging: 0 }
    }

    /// Counts one sighting and returns the (over-)estimate of the id's recent count.
    fn see(&mut self, id: u64) -> u32 {
        self.since_aging += 1;
        if self.since_aging >= Self::AGE_PERIOD {
            self.counters.iter_mut().for_each(|c| *c /= 2);
            self.since_aging = 0;
        }
        let mut least = u8::MAX;
        for row in 0..4u64 {
            let h = mix(id, row + 1);
            let i = (row as usize) << Self::WIDTH_BITS | (h >> (64 - Self::WIDTH_BITS)) as usize;
            self.counters[i] = self.counters[i].saturating_add(1);
            least = least.min(self.counters[i]);
        }
        u32::from(least)
    }
}

/// Counters of a table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TableStats {
    /// Rows held now.
    pub rows: u64,
    /// Bytes held now (row data, metadata and index).
    pub bytes: u64,
    /// Rows ever created.
    pub created: u64,
    /// Rows evicted (budget or TTL).
    pub evicted: u64,
    /// Looked-up ids not yet admitted (answered with initial values, not stored).
    pub not_admitted: u64,
    /// Pushed rows dropped because the row did not exist (never admitted, or evicted since the pull).
    pub dropped_updates: u64,
}

/// The seeded initial values of row `id`: they depend on (seed, table, id) only, not on the shard or on
/// when the row was created.
fn initial_values(cfg: &TableConfig, id: u64, out: &mut [f32]) {
    if cfg.init_std == 0.0 {
        out.iter_mut().for_each(|v| *v = 0.0);
        return;
    }
    let mut rng = Rng::new(mix(mix(cfg.seed, u64::from(cfg.table)), id));
    out.iter_mut().for_each(|v| *v = (rng.normal() * f64::from(cfg.init_std)) as f32);
}

/// What a table keeps of each row beside its values and state, together so that one cache line holds all
/// of it (a lookup confirms the id where an update then reads the version and sets the time).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(align(16))]
struct RowMeta {
    /// The feature id.
    id: u64,
    /// Updates applied to the row.
    version: u32,
    /// When it was last pulled or pushed (`now_s`), for eviction.
    touched: u32,
}

/// One sparse table.
#[derive(Debug)]
pub struct SparseTable {
    cfg: TableConfig,
    stride: usize,
    index: Vec<u32>,
    meta: Vec<RowMeta>,
    data: Vec<f32>,
    sightings: Option<Sightings>,
    sampler: Rng,
    stats: TableStats,
}

impl SparseTable {
    /// Where the eviction sampler is (a backup's copy continues it, `ShardCore::copy_state`).
    pub(crate) fn sampler_state(&self) -> [u64; 4] {
        self.sampler.state()
    }

    /// Continues the eviction sampler from [`Self::sampler_state`].
    pub(crate) fn set_sampler_state(&mut self, s: [u64; 4]) {
        self.sampler = Rng::from_state(s);
    }

    /// A new, empty table.
    pub fn new(cfg: TableConfig) -> Result<Self, TableError> {
        let layout = cfg.rule.layout();
        if layout.worker_planes > 0 || layout.lookahead {
            return Err(TableError(format!(
                "rule {} keeps state per worker or a look-ahead, which sparse rows do not support; use sgd, momentum, nesterov, staleness-aware, dc-asgd, gap-aware, dana-slim, adagrad, adam, nadam or gap-adam",
                cfg.rule
            )));
        }
        if cfg.dim == 0 || cfg.dim > 4096 {
            return Err(TableError(format!("dim must be in 1..=4096, got {}", cfg.dim)));
        }
        if cfg.admit_after > MAX_ADMIT_AFTER {
            return Err(TableError(format!(
                "admit-after must be at most {MAX_ADMIT_AFTER} (the admission sketch counts to {MAX_ADMIT_AFTER}), got {}",
                cfg.admit_after
            )));
        }
        if !(cfg.init_std.is_finite() && cfg.init_std >= 0.0) {
            return Err(TableError(format!("init std must be ≥ 0, got {}", cfg.init_std)));
        }
        let stride = cfg.dim as usize * (1 + layout.shared_planes);
        if let Some(budget) = cfg.memory_budget {
            // A budget that holds almost nothing is a mistake (1KiB for 1GiB, say): the table would evict
            // every row it creates and training would silently run on initial values.
            let row = stride as u64 * 4 + META_BYTES_PER_ROW;
            let needed = MIN_ROWS_IN_BUDGET * row + INITIAL_INDEX_SLOTS as u64 * 4;
            if budget < needed {
                return Err(TableError(format!(
                    "a memory budget of {budget} bytes holds {} rows of {row} bytes; give at least {needed} bytes ({MIN_ROWS_IN_BUDGET} rows and the index) or no budget",
                    budget.saturating_sub(INITIAL_INDEX_SLOTS as u64 * 4) / row
                )));
            }
        }
        let sightings = (cfg.admit_after > 1).then(Sightings::new);
        let sampler = Rng::new(mix(cfg.seed, 0xe71c));
        Ok(SparseTable {
            cfg,
            stride,
            index: vec![EMPTY; INITIAL_INDEX_SLOTS],
            meta: Vec::new(),
            data: Vec::new(),
            sightings,
            sampler,
            stats: TableStats::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &TableConfig {
        &self.cfg
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.meta.len()
    }

    /// Bytes held: row data + per-row metadata + index.
    pub fn bytes(&self) -> u64 {
        self.meta.len() as u64 * (self.stride as u64 * 4 + META_BYTES_PER_ROW) + self.index.len() as u64 * 4
    }

    /// Moves the table's rows, metadata and index onto huge pages now, as the kernel's background merging
    /// does over minutes after the table grew ([`gaps_common::buffers::collapse_huge_pages`]; the rows are
    /// remapped, not copied, when their arena doubles, and those moved stay on small pages until merged).
    /// For benchmarks that measure the table as it runs once merged. The bytes merged; None where the
    /// kernel could merge none of its arrays.
    pub fn collapse_huge_pages(&self) -> Option<usize> {
        use gaps_common::buffers::collapse_huge_pages;
        let merged =
            [collapse_huge_pages(&self.index), collapse_huge_pages(&self.meta), collapse_huge_pages(&self.data)];
        merged.iter().any(Option::is_some).then(|| merged.iter().flatten().sum())
    }

    /// Bytes per row beyond the row data (metadata and index), the figure the design bounds by 32.
    pub fn overhead_per_row(&self) -> f64 {
        let rows = self.meta.len().max(1) as f64;
        (self.meta.len() as u64 * META_BYTES_PER_ROW + self.index.len() as u64 * 4) as f64 / rows
    }

    /// Counters.
    pub fn stats(&self) -> TableStats {
        TableStats { rows: self.meta.len() as u64, bytes: self.bytes(), ..self.stats }
    }

    /// The hash of `id` in this table: its low bits pick the home slot, its high bits the tag.
    fn hash(&self, id: u64) -> u64 {
        mix(id, u64::from(self.cfg.table))
    }

    fn home(&self, id: u64) -> usize {
        self.home_of(self.hash(id))
    }

    fn home_of(&self, hash: u64) -> usize {
        (hash as usize) & (self.index.len() - 1)
    }

    /// The bits of a slot that hold the row number (every row number is below the slot count, so all ones —
    /// [`EMPTY`] — is never a row); the others hold the tag.
    fn row_mask(&self) -> u32 {
        (self.index.len() - 1).min(u32::MAX as usize) as u32
    }

    /// The slot naming `row` for an id of hash `hash`.
    fn entry(&self, hash: u64, row: u32) -> u32 {
        ((hash >> 32) as u32 & !self.row_mask()) | row
    }

    /// The row a slot names if its tag is that of `hash` (None: another id's slot).
    #[inline(always)]
    fn tagged_row(&self, slot: u32, hash: u64) -> Option<u32> {
        let mask = self.row_mask();
        ((slot ^ (hash >> 32) as u32) & !mask == 0).then_some(slot & mask)
    }

    /// The first row from `id`'s home slot whose tag is `id`'s and that `accept`s, or [`EMPTY`] at the
    /// first empty slot.
    #[inline(always)]
    fn probe(&self, id: u64, accept: impl Fn(u32) -> bool) -> u32 {
        let (hash, mask) = (self.hash(id), self.index.len() - 1);
        let mut i = self.home_of(hash);
        loop {
            let slot = self.index[i];
            if slot == EMPTY {
                return EMPTY;
            }
            if let Some(row) = self.tagged_row(slot, hash).filter(|r| accept(*r)) {
                return row;
            }
            i = (i + 1) & mask;
        }
    }

    /// The first row from `id`'s home slot whose tag is `id`'s (to confirm against the id array), or
    /// [`EMPTY`]: a probe that reads no other array.
    #[inline(always)]
    fn candidate(&self, id: u64) -> u32 {
        self.probe(id, |_| true)
    }

    /// The row number of `id`, if held.
    fn find(&self, id: u64) -> Option<usize> {
        let row = self.probe(id, |r| self.meta[r as usize].id == id);
        (row != EMPTY).then_some(row as usize)
    }

    /// Index slot holding row `row` (which must be present).
    fn slot_of(&self, row: usize) -> usize {
        let (mask, rows) = (self.index.len() - 1, self.row_mask());
        let mut i = self.home(self.meta[row].id);
        while (self.index[i] & rows) as usize != row {
            i = (i + 1) & mask;
        }
        i
    }

    fn insert_index(&mut self, row: u32) {
        let mask = self.index.len() - 1;
        let hash = self.hash(self.meta[row as usize].id);
        let mut i = self.home_of(hash);
        while self.index[i] != EMPTY {
            i = (i + 1) & mask;
        }
        self.index[i] = self.entry(hash, row);
    }

    /// Whether `rows` more rows fit without growing the index (a rebuild of all of it), the metadata (a copy
    /// of all of it) or the rows' arena (a remap): creating them then costs in proportion to `rows`, not to
    /// the table.
    pub fn has_room_for(&self, rows: u64) -> bool {
        let after = (self.meta.len() as u64).saturating_add(rows);
        self.index_holds(after)
            && after <= self.meta.capacity() as u64
            && after.saturating_mul(self.stride as u64) <= self.data.capacity() as u64
    }

    /// Whether the index holds `rows` rows within its load factor (0.8).
    fn index_holds(&self, rows: u64) -> bool {
        rows.saturating_mul(5) <= self.index.len() as u64 * 4
    }

    fn grow_index_if_needed(&mut self) {
        if self.index_holds(self.meta.len() as u64 + 1) {
            return;
        }
        let capacity = self.index.len() * 2;
        self.index = filled_huge(capacity, EMPTY);
        for row in 0..self.meta.len() as u32 {
            self.insert_index(row);
        }
    }

    /// About how many bytes [`SparseTable::write_to`] appends.
    pub(crate) fn checkpoint_size_hint(&self) -> usize {
        self.meta.len() * 16 + self.data.len() * 4 + self.sightings.as_ref().map_or(0, |s| s.counters.len()) + 128
    }

    /// Appends the table's rows, their state, versions and last touches, the admission sketch and the
    /// counters to a checkpoint (the index is rebuilt on restore).
    pub(crate) fn write_to(&self, w: &mut crate::checkpoint::Writer) {
        w.u64s_of(self.meta.iter().map(|m| m.id));
        w.u32s_of(self.meta.iter().map(|m| m.version));
        w.u32s_of(self.meta.iter().map(|m| m.touched));
        w.f32s(&self.data);
        match &self.sightings {
            Some(s) => {
                w.u8(1);
                w.bytes(&s.counters);
                w.u64(s.since_aging);
            }
            None => w.u8(0),
        }
        let st = &self.stats;
        w.u64s(&[st.created, st.evicted, st.not_admitted, st.dropped_updates]);
    }

    /// Replaces this (empty, freshly configured) table's contents with a checkpoint's.
    pub(crate) fn read_from(
        &mut self,
        r: &mut crate::checkpoint::Reader<'_>,
    ) -> Result<(), crate::checkpoint::CheckpointError> {
        use crate::checkpoint::CheckpointError::{Corrupt, Mismatch};
        let name = format!("table {}", self.cfg.table);
        let ids = r.u64s(&name)?;
        let versions = r.u32s(&name)?;
        let touched = r.u32s(&name)?;
        let data = r.f32s(&name)?;
        if versions.len() != ids.len() || touched.len() != ids.len() {
            return Err(Corrupt(format!(
                "{name}: {} ids but {} versions and {} times",
                ids.len(),
                versions.len(),
                touched.len()
            )));
        }
        if data.len() != ids.len() * self.stride {
            return Err(Mismatch(format!(
                "{name}: {} floats for {} rows, this shard keeps {} per row (another dim or rule?)",
                data.len(),
                ids.len(),
                self.stride
            )));
        }
        self.sightings = match r.u8()? {
            0 => None,
            _ => {
                let counters = r.bytes(&name)?;
                if counters.len() != 4 << Sightings::WIDTH_BITS {
                    return Err(Corrupt(format!("{name}: admission sketch of {} bytes", counters.len())));
                }
                Some(Sightings { counters, since_aging: r.u64()? })
            }
        };
        if self.sightings.is_none() && self.cfg.admit_after > 1 {
            self.sightings = Some(Sightings::new());
        }
        let st = r.u64s(&name)?;
        let [created, evicted, not_admitted, dropped_updates] = st[..] else {
            return Err(Corrupt(format!("{name}: {} counters", st.len())));
        };
        self.stats = TableStats { created, evicted, not_admitted, dropped_updates, ..TableStats::default() };
        let mut capacity = INITIAL_INDEX_SLOTS;
        while ids.len() * 5 > capacity * 4 {
            capacity *= 2;
        }
        self.meta = ids
            .into_iter()
            .zip(versions.into_iter().zip(touched))
            .map(|(id, (version, touched))| RowMeta { id, version, touched })
            .collect();
        self.data = data;
        // What the checkpoint was read into is on small pages; the kernel may move it to huge ones in the
        // background (a copy would hold the table twice while it restores).
        advise_huge_pages(&self.meta);
        advise_huge_pages(&self.data);
        self.index = filled_huge(capacity, EMPTY);
        for row in 0..self.meta.len() {
            if self.find(self.meta[row].id).is_some() {
                return Err(Corrupt(format!("{name}: id {} appears twice", self.meta[row].id)));
            }
            self.insert_index(row as u32);
        }
        Ok(())
    }

    /// The initial value of a row (also what a not-yet-admitted id reads).
    fn initial_row(&self, id: u64, out: &mut [f32]) {
        initial_values(&self.cfg, id, out);
    }

    fn create(&mut self, id: u64, now_s: u32) -> usize {
        self.grow_index_if_needed();
        let row = self.meta.len();
        // On huge pages (a random lookup in a table of gigabytes then walks the page tables once per 2 MiB,
        // not once per row): the metadata (16 bytes a row) grows by copying into huge pages; the rows, too
        // large to copy on the core's thread at every doubling, are remapped and advised, so rows created
        // from then on are on huge pages and the rest is merged by the kernel in the background.
        reserve_huge(&mut self.meta, 1);
        reserve_advised(&mut self.data, self.stride);
        self.meta.push(RowMeta { id, version: 0, touched: now_s });
        self.data.resize(self.data.len() + self.stride, 0.0);
        let dim = self.cfg.dim as usize;
        initial_values(&self.cfg, id, &mut self.data[row * self.stride..row * self.stride + dim]);
        if self.cfg.rule == Rule::Adagrad && self.cfg.adagrad_init > 0.0 {
            let state = row * self.stride + dim..row * self.stride + 2 * dim;
            self.data[state].iter_mut().for_each(|x| *x = self.cfg.adagrad_init);
        }
        self.insert_index(row as u32);
        self.stats.created += 1;
        row
    }

    /// Removes row `row`: backward-shift deletion in the index, then the last row moves into its place.
    fn remove(&mut self, row: usize) {
        let mask = self.index.len() - 1;
        let mut hole = self.slot_of(row);
        let mut j = (hole + 1) & mask;
        while self.index[j] != EMPTY {
            let home = self.home(self.meta[(self.index[j] & self.row_mask()) as usize].id);
            // Move the entry at j back into the hole unless its home lies cyclically in (hole, j].
            let stays = if hole <= j { hole < home && home <= j } else { hole < home || home <= j };
            if !stays {
                self.index[hole] = self.index[j];
                hole = j;
            }
            j = (j + 1) & mask;
        }
        self.index[hole] = EMPTY;
        let last = self.meta.len() - 1;
        if row != last {
            let slot = self.slot_of(last);
            self.index[slot] = self.entry(self.hash(self.meta[last].id), row as u32);
            self.meta.swap(row, last);
            let (head, tail) = self.data.split_at_mut(last * self.stride);
            head[row * self.stride..(row + 1) * self.stride].copy_from_slice(&tail[..self.stride]);
        }
        self.meta.pop();
        self.data.truncate(last * self.stride);
        self.stats.evicted += 1;
    }

    /// Evicts (approximately least recently used) rows until the table fits its budget.
    fn enforce_budget(&mut self) {
        let Some(budget) = self.cfg.memory_budget else { return };
        while self.bytes() > budget && !self.meta.is_empty() {
            let n = self.meta.len() as u64;
            let mut victim = self.sampler.below(n) as usize;
            for _ in 0..7 {
                let r = self.sampler.below(n) as usize;
                if self.meta[r].touched < self.meta[victim].touched {
                    victim = r;
                }
            }
            self.remove(victim);
        }
    }

    /// Reads rows for a pull: writes `dim` values and the version per id. Rows are created on first touch
    /// (once admitted); ids not admitted yet read their initial values with version 0 and are not stored.
    pub fn pull(&mut self, ids: &[u64], now_s: u32, values: &mut Vec<f32>, versions: &mut Vec<u32>) {
        let dim = self.cfg.dim as usize;
        // Every row held (the common case once a table is warm): looked up as a batch, nothing created.
        let mut rows = Vec::with_capacity(ids.len());
        self.locate(ids, &mut rows);
        if !rows.contains(&EMPTY) {
            for (k, &r) in rows.iter().enumerate() {
                self.prefetch_row(&rows, k);
                let r = r as usize;
                self.meta[r].touched = now_s;
                values.extend_from_slice(&self.data[r * self.stride..r * self.stride + dim]);
                versions.push(self.meta[r].version);
            }
            // Nothing was created, but a table restored under a smaller budget is trimmed here as the
            // first pull after the restore always did.
            self.enforce_budget();
            return;
        }
        for &id in ids {
            let row = match self.find(id) {
                Some(r) => Some(r),
                None => {
                    let admitted = match self.sightings.as_mut() {
                        Some(s) => s.see(id) >= self.cfg.admit_after,
                        None => true,
                    };
                    admitted.then(|| self.create(id, now_s))
                }
            };
            match row {
                Some(r) => {
                    self.meta[r].touched = now_s;
                    values.extend_from_slice(&self.data[r * self.stride..r * self.stride + dim]);
                    versions.push(self.meta[r].version);
                }
                None => {
                    self.stats.not_admitted += 1;
                    let start = values.len();
                    values.resize(start + dim, 0.0);
                    self.initial_row(id, &mut values[start..]);
                    versions.push(0);
                }
            }
        }
        self.enforce_budget();
    }

    /// Rows from storage position `from`, at most `max`: their ids and values (the row's `dim` floats, not
    /// the rule's state) appended to `ids` and `values`; the position to go on from, None at the end. A scan
    /// while rows are created or evicted may miss or repeat rows (stop training first for an exact export).
    pub fn scan(&self, from: usize, max: usize, ids: &mut Vec<u64>, values: &mut Vec<f32>) -> Option<usize> {
        let dim = self.cfg.dim as usize;
        let end = from.saturating_add(max).min(self.meta.len());
        for r in from.min(end)..end {
            ids.push(self.meta[r].id);
            values.extend_from_slice(&self.data[r * self.stride..r * self.stride + dim]);
        }
        (end < self.meta.len()).then_some(end)
    }

    /// Loads row `id` with `values` (`dim` floats) when the table holds no such row — an import: created at
    /// once (no admission), its rule state fresh, version 1 (a gradient computed on the row's initial values
    /// is one update stale). A held row keeps its values. True when it was created.
    pub fn load(&mut self, id: u64, values: &[f32], now_s: u32) -> bool {
        if self.find(id).is_some() {
            return false;
        }
        let dim = self.cfg.dim as usize;
        let r = self.create(id, now_s);
        self.data[r * self.stride..r * self.stride + dim].copy_from_slice(&values[..dim]);
        self.meta[r].version = 1;
        true
    }

    /// Evicts rows until the table fits its budget (after a load).
    pub fn fit_budget(&mut self) {
        self.enforce_budget();
    }

    /// Reads rows without creating, admitting or touching anything (evaluation): held rows as they are,
    /// others their initial values, with version 0.
    pub fn peek(&self, ids: &[u64], values: &mut Vec<f32>, versions: &mut Vec<u32>) {
        let dim = self.cfg.dim as usize;
        let mut rows = Vec::with_capacity(ids.len());
        self.locate(ids, &mut rows);
        for (k, (&id, &row)) in ids.iter().zip(&rows).enumerate() {
            self.prefetch_row(&rows, k);
            let start = values.len();
            match (row != EMPTY).then_some(row as usize) {
                Some(r) => {
                    values.extend_from_slice(&self.data[r * self.stride..r * self.stride + dim]);
                    versions.push(self.meta[r].version);
                }
                None => {
                    values.resize(start + dim, 0.0);
                    self.initial_row(id, &mut values[start..]);
                    versions.push(0);
                }
            }
        }
    }

    /// Applies a push: one gradient row per id (ids must be distinct; the caller checks), `reads` holds the
    /// rows the gradients were computed on when the rule needs them; `base` gives the push's learning rates
    /// and worker count (staleness and update count are each row's own). Rows that do not exist are skipped
    /// and counted. Returns the largest staleness.
    #[allow(clippy::too_many_arguments)]
    pub fn push(
        &mut self,
        ids: &[u64],
        read_versions: &[u32],
        grads: &[f32],
        reads: &[f32],
        hyper: &Hyper,
        base: PushScalars,
        now_s: u32,
    ) -> Result<u64, KernelError> {
        let mut rows = Vec::with_capacity(ids.len());
        self.locate(ids, &mut rows);
        let dropped = rows.iter().filter(|r| **r == EMPTY).count();
        self.stats.dropped_updates += dropped as u64;
        let push = batch::RowPush { grads, reads, read_versions, hyper, base, now_s };
        if self.cfg.rule.scalars_per_row() || self.cfg.rule.layout().shared_planes > 2 || rows.len() - dropped < 2 {
            self.push_rows(&rows, push)
        } else {
            self.push_in_place(&rows, push)
        }
    }

    /// Writes into `out` the values row `id` would have after an update with `grad` (computed on its
    /// current values), changing nothing: what a gba pull reads of a row the step in progress holds a
    /// gradient for. False (and `out` untouched) when the row is not held. `scratch` is working space,
    /// reused from call to call.
    pub fn preview(
        &self,
        id: u64,
        grad: &[f32],
        hyper: &Hyper,
        base: PushScalars,
        out: &mut [f32],
        scratch: &mut Vec<f32>,
    ) -> Result<bool, KernelError> {
        let Some(r) = self.find(id) else { return Ok(false) };
        let dim = self.cfg.dim as usize;
        let layout = self.cfg.rule.layout();
        // The row and its state, then (for rules that measure drift) the values read.
        scratch.clear();
        scratch.extend_from_slice(&self.data[r * self.stride..(r + 1) * self.stride]);
        if layout.needs_read {
            scratch.extend_from_slice(&self.data[r * self.stride..r * self.stride + dim]);
        }
        let (row, read) = scratch.split_at_mut(self.stride);
        let (params, state) = row.split_at_mut(dim);
        let (s0, s1) = state.split_at_mut(if layout.shared_planes >= 1 { dim } else { 0 });
        let bufs = Bufs { params, s0, s1, w0: &mut [], grad, read };
        let scalars = PushScalars { staleness: 0, t: u64::from(self.meta[r].version) + 1, ..base };
        gaps_kernels::apply(self.cfg.rule, hyper, &scalars, bufs)?;
        out.copy_from_slice(&scratch[..dim]);
        Ok(true)
    }

    /// Removes rows idle longer than the TTL (TTL eviction only). Returns how many.
    pub fn tick(&mut self, now_s: u32) -> u64 {
        let Eviction::Ttl { ttl_s } = self.cfg.eviction else { return 0 };
        let before = self.stats.evicted;
        let mut r = 0;
        while r < self.meta.len() {
            if now_s.saturating_sub(self.meta[r].touched) > ttl_s {
                self.remove(r); // the last row moved into r; look at r again
            } else {
                r += 1;
            }
        }
        self.stats.evicted - before
    }

    /// Counts row updates dropped by the caller because the row is not held.
    pub fn count_dropped(&mut self, rows: u64) {
        self.stats.dropped_updates += rows;
    }

    /// The version (updates applied) of a held row.
    pub fn version(&self, id: u64) -> Option<u32> {
        self.find(id).map(|r| self.meta[r].version)
    }

    /// The values of a held row (tests, evaluation).
    pub fn row(&self, id: u64) -> Option<&[f32]> {
        self.find(id).map(|r| &self.data[r * self.stride..r * self.stride + self.cfg.dim as usize])
    }
}

#[cfg(test)]
mod tests;
