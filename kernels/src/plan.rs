//! The device-resident layout of a shard's dense state and the copy plan of each push and pull
//! (issue 16 part 1): what [`crate::resident::Resident`] follows on a device and what `rules.cu`'s
//! `gaps_update_table` reads.
//!
//! Every dense chunk gets one offset, the same in each arena: parameters, shared plane 0, shared plane 1.
//! Per-worker planes live in a worker arena, one stripe of `total` floats per worker slot. The arenas are
//! allocated once, when the shard starts; nothing about the state moves afterwards. A push is staged in one
//! pinned host buffer (every chunk's gradient, then the read echoes of the chunks whose rule needs them),
//! copied to the device in one transfer, and applied by one launch over a chunk table (more only past
//! 65,535 chunks, the grid's y limit). A pull copies back only the parameters of the chunks asked for
//! (for DANA's look-ahead also the momentum plane, from which the host computes it).

use crate::{KernelError, Rule};

/// Chunks one launch can cover (CUDA's grid y dimension).
pub const MAX_ENTRIES_PER_LAUNCH: usize = 65_535;

/// Where one dense chunk's state sits on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkSlot {
    /// Offset, in floats, in the parameter and shared-plane arenas.
    pub offset: u64,
    /// Floats in the chunk.
    pub len: u32,
    /// Its update rule.
    pub rule: Rule,
}

/// The arenas' sizes, in floats (a plane no chunk's rule uses gets no arena).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaSizes {
    /// θ.
    pub params: u64,
    /// Shared planes 0 and 1.
    pub shared: [u64; 2],
    /// Per-worker planes: one stripe per worker slot.
    pub worker: u64,
}

/// A shard's dense state laid out in device arenas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceLayout {
    slots: Vec<ChunkSlot>,
    total: u64,
    worker_slots: u32,
}

/// One entry of a push's chunk table: the offsets (in floats), length and rule of `rules.cu`'s `TableEntry`
/// (the executor adds each chunk's scalars).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableEntry {
    /// The chunk's offset in the parameter and shared-plane arenas.
    pub param_offset: u64,
    /// The pushing worker's stripe for this chunk in the worker arena.
    pub worker_offset: u64,
    /// The chunk's gradient in the staged push.
    pub grad_offset: u64,
    /// The chunk's read echo in the staged push (unused by rules that take none).
    pub read_offset: u64,
    /// Floats.
    pub len: u32,
    /// The rule's index in [`Rule::ALL`].
    pub rule: i32,
}

/// What one push moves and launches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushPlan {
    /// The chunk table, in the push's order.
    pub table: Vec<TableEntry>,
    /// Floats staged in the pinned buffer and copied to the device in one transfer: gradients, then echoes.
    pub staged_floats: u64,
    /// Kernel launches.
    pub launches: usize,
}

impl PushPlan {
    /// Bytes copied host → device.
    pub fn bytes_to_device(&self) -> u64 {
        4 * self.staged_floats
    }
}

/// What one pull copies back: for each chunk asked, its offset and length, and whether the device first
/// computes the look-ahead into the staging area.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullPlan {
    /// (offset in the parameter arena, floats, look-ahead).
    pub copies: Vec<(u64, u32, bool)>,
}

impl PullPlan {
    /// Bytes copied device → host.
    pub fn bytes_to_host(&self) -> u64 {
        self.copies.iter().map(|(_, len, _)| 4 * u64::from(*len)).sum()
    }
}

impl DeviceLayout {
    /// Lays out `chunks` (floats, rule) in order, with `worker_slots` stripes for per-worker planes.
    pub fn new(chunks: &[(u32, Rule)], worker_slots: u32) -> Result<Self, KernelError> {
        let mut offset = 0u64;
        let mut slots = Vec::with_capacity(chunks.len());
        for (i, (len, rule)) in chunks.iter().enumerate() {
            if *len == 0 {
                return Err(KernelError::Internal(format!("chunk {i} is empty")));
            }
            if rule.layout().worker_planes > 1 || rule.layout().shared_planes > 2 {
                return Err(KernelError::Internal(format!("rule {rule} has more planes than the arenas")));
            }
            slots.push(ChunkSlot { offset, len: *len, rule: *rule });
            offset += u64::from(*len);
        }
        Ok(DeviceLayout { slots, total: offset, worker_slots })
    }

    /// The chunks' slots.
    pub fn slots(&self) -> &[ChunkSlot] {
        &self.slots
    }

    /// Stripes of the worker arena: how many workers can hold per-worker planes at once.
    pub fn worker_slots(&self) -> u32 {
        self.worker_slots
    }

    /// The arenas to allocate once.
    pub fn arena_sizes(&self) -> ArenaSizes {
        let uses = |f: &dyn Fn(Rule) -> bool| self.slots.iter().any(|s| f(s.rule));
        let plane = |k: usize| if uses(&|r: Rule| r.layout().shared_planes > k) { self.total } else { 0 };
        let worker =
            if uses(&|r: Rule| r.layout().worker_planes > 0) { self.total * u64::from(self.worker_slots) } else { 0 };
        ArenaSizes { params: self.total, shared: [plane(0), plane(1)], worker }
    }

    /// The plan of a push of `chunks` (indices into the layout, each at most once) by `worker_slot`.
    pub fn push_plan(&self, chunks: &[usize], worker_slot: u32) -> Result<PushPlan, KernelError> {
        let mut seen = vec![false; self.slots.len()];
        let mut table = Vec::with_capacity(chunks.len());
        let mut staged = 0u64;
        for &c in chunks {
            let slot = self.slots.get(c).ok_or_else(|| KernelError::Internal(format!("no chunk {c}")))?;
            if std::mem::replace(&mut seen[c], true) {
                return Err(KernelError::Internal(format!("chunk {c} twice in one push")));
            }
            if slot.rule.layout().worker_planes > 0 && worker_slot >= self.worker_slots {
                return Err(KernelError::Internal(format!(
                    "worker slot {worker_slot}, but {} stripes were allocated",
                    self.worker_slots
                )));
            }
            table.push(TableEntry {
                param_offset: slot.offset,
                worker_offset: u64::from(worker_slot) * self.total + slot.offset,
                grad_offset: staged,
                read_offset: 0,
                len: slot.len,
                rule: Rule::ALL.iter().position(|r| *r == slot.rule).unwrap_or(0) as i32,
            });
            staged += u64::from(slot.len);
        }
        for (entry, &c) in table.iter_mut().zip(chunks) {
            if self.slots[c].rule.layout().needs_read {
                entry.read_offset = staged;
                staged += u64::from(entry.len);
            }
        }
        Ok(PushPlan { launches: table.len().div_ceil(MAX_ENTRIES_PER_LAUNCH).max(1), table, staged_floats: staged })
    }

    /// The plan of a pull of `chunks`.
    pub fn pull_plan(&self, chunks: &[usize]) -> Result<PullPlan, KernelError> {
        let copies = chunks
            .iter()
            .map(|&c| {
                let s = self.slots.get(c).ok_or_else(|| KernelError::Internal(format!("no chunk {c}")))?;
                Ok((s.offset, s.len, s.rule.layout().lookahead))
            })
            .collect::<Result<_, KernelError>>()?;
        Ok(PullPlan { copies })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_push_copies_only_its_gradient_and_echo_for_every_rule() {
        for rule in Rule::ALL {
            let chunks: Vec<(u32, Rule)> = [4096u32, 4096, 1000, 7].iter().map(|n| (*n, rule)).collect();
            let layout = DeviceLayout::new(&chunks, 4).expect("layout");
            let sizes = layout.arena_sizes();
            let l = rule.layout();
            assert_eq!(sizes.params, 9199);
            assert_eq!(
                sizes.shared,
                [if l.shared_planes > 0 { 9199 } else { 0 }, if l.shared_planes > 1 { 9199 } else { 0 }]
            );
            assert_eq!(sizes.worker, if l.worker_planes > 0 { 4 * 9199 } else { 0 }, "{rule}");
            let plan = layout.push_plan(&[2, 0, 3], 3).expect("plan");
            let grads = 1000 + 4096 + 7;
            let expected = grads * if l.needs_read { 2 } else { 1 };
            // Exactly the gradient and, where the rule needs it, the echo; no optimizer state crosses.
            assert_eq!(plan.bytes_to_device(), 4 * expected, "{rule}");
            assert_eq!(plan.launches, 1);
            assert_eq!(plan.table.iter().map(|e| e.param_offset).collect::<Vec<_>>(), [8192, 0, 9192]);
            assert_eq!(plan.table.iter().map(|e| e.grad_offset).collect::<Vec<_>>(), [0, 1000, 5096]);
            assert!(plan.table.iter().all(|e| e.worker_offset == 3 * 9199 + e.param_offset));
            assert!(plan.table.iter().all(|e| Rule::ALL[e.rule as usize] == rule));
            if l.needs_read {
                assert_eq!(plan.table.iter().map(|e| e.read_offset).collect::<Vec<_>>(), [5103, 6103, 10199]);
            }
            // Staged ranges never overlap and stay inside the staging buffer.
            let mut ranges: Vec<(u64, u64)> = plan.table.iter().map(|e| (e.grad_offset, u64::from(e.len))).collect();
            if l.needs_read {
                ranges.extend(plan.table.iter().map(|e| (e.read_offset, u64::from(e.len))));
            }
            ranges.sort_unstable();
            assert!(ranges.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0));
            assert!(ranges.last().is_some_and(|(o, n)| o + n == plan.staged_floats));
            let pull = layout.pull_plan(&[1, 3]).expect("pull");
            assert_eq!(pull.bytes_to_host(), 4 * (4096 + 7));
            assert!(pull.copies.iter().all(|c| c.2 == l.lookahead));
        }
    }

    #[test]
    fn mixed_rules_share_the_arenas_and_bad_plans_are_refused() {
        let layout =
            DeviceLayout::new(&[(100, Rule::Momentum), (50, Rule::GapAware), (10, Rule::DanaZero)], 2).expect("layout");
        // Gap-Aware needs two shared planes and DANA-Zero a per-worker one: every arena spans all chunks.
        assert_eq!(layout.arena_sizes(), ArenaSizes { params: 160, shared: [160, 160], worker: 320 });
        let plan = layout.push_plan(&[0, 1, 2], 1).expect("plan");
        // Only Gap-Aware's chunk carries an echo.
        assert_eq!(plan.staged_floats, 160 + 50);
        assert_eq!(plan.table[1].read_offset, 160);
        assert!(layout.push_plan(&[0, 0], 0).is_err(), "a chunk twice");
        assert!(layout.push_plan(&[3], 0).is_err(), "no such chunk");
        assert!(layout.push_plan(&[2], 2).is_err(), "a worker slot without a stripe");
        assert!(layout.push_plan(&[0], 7).is_ok(), "momentum keeps no per-worker plane");
        assert!(DeviceLayout::new(&[(0, Rule::Sgd)], 1).is_err());
        // More chunks than one grid holds take more launches.
        let many = DeviceLayout::new(&vec![(1, Rule::Sgd); MAX_ENTRIES_PER_LAUNCH + 1], 1).expect("layout");
        let all: Vec<usize> = (0..=MAX_ENTRIES_PER_LAUNCH).collect();
        assert_eq!(many.push_plan(&all, 0).expect("plan").launches, 2);
    }
}
