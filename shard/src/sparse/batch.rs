//! Rows a batch at a time: a batch of ids looked up with what each step reads next fetched ahead, and a
//! push's rows updated where they lie with constants derived once where the rule allows it (see
//! [`SparseTable::push`]).

use super::*;

/// What a push brings to its rows: `grads` (and, where the rule echoes, `reads`) row after row, in the order
/// of the push's ids, with the version each row was read at; the table's hyper-parameters, the push's
/// scalars and the time.
#[derive(Clone, Copy)]
pub(super) struct RowPush<'a> {
    pub(super) grads: &'a [f32],
    pub(super) reads: &'a [f32],
    pub(super) read_versions: &'a [u32],
    pub(super) hyper: &'a Hyper,
    pub(super) base: PushScalars,
    pub(super) now_s: u32,
}

/// How many updates were applied to a row since it was read at `read` (a row evicted and re-created since
/// the read restarts its count: that read counts as current).
#[inline(always)]
fn staleness(version: u32, read: u32) -> u64 {
    u64::from(version.saturating_sub(read))
}

impl SparseTable {
    /// The row of each of `ids` (`EMPTY` where it is not held), into `rows`. Two passes, each fetching
    /// [`AHEAD`] ids in advance what it reads next — the index slots, then the ids of the rows they name
    /// (the passes over the rows fetch their data the same way, [`Self::prefetch_row`]): in a table far
    /// larger than the caches each lookup costs a few memory latencies, which overlap here instead of each
    /// waiting for the one before.
    pub(super) fn locate(&self, ids: &[u64], rows: &mut Vec<u32>) {
        rows.clear();
        for (k, &id) in ids.iter().enumerate() {
            if let Some(&ahead) = ids.get(k + AHEAD) {
                prefetch(&self.index, self.home(ahead));
            }
            rows.push(self.candidate(id));
        }
        for k in 0..ids.len() {
            if let Some(&ahead) = rows.get(k + AHEAD).filter(|r| **r != EMPTY) {
                prefetch(&self.meta, ahead as usize);
            }
            let guess = rows[k];
            if guess != EMPTY && self.meta[guess as usize].id != ids[k] {
                // Another id with the same tag (one probe in 2^tag bits): followed the usual way.
                rows[k] = self.find(ids[k]).map_or(EMPTY, |r| r as u32);
            }
        }
    }

    /// Fetches what a pass over `rows` reads of the row [`AHEAD`] places after `k`: its values and state
    /// (every cache line), version and time.
    #[inline(always)]
    pub(super) fn prefetch_row(&self, rows: &[u32], k: usize) {
        self.prefetch_row_at(rows, k + AHEAD)
    }

    /// Fetches what a pass reads of `rows[k]` (nothing past the end or for a row not held).
    #[inline(always)]
    pub(super) fn prefetch_row_at(&self, rows: &[u32], k: usize) {
        if let Some(&r) = rows.get(k).filter(|r| **r != EMPTY) {
            let r = r as usize;
            for line in (0..self.stride).step_by(16) {
                prefetch(&self.data, r * self.stride + line);
            }
            prefetch(&self.meta, r);
        }
    }

    /// A push's rows updated one call each, with the row's own staleness and update count; the largest
    /// staleness.
    pub(super) fn push_rows(&mut self, rows: &[u32], push: RowPush<'_>) -> Result<u64, KernelError> {
        let RowPush { grads, reads, read_versions, hyper, base, now_s } = push;
        let dim = self.cfg.dim as usize;
        let planes = self.cfg.rule.layout().shared_planes;
        let mut max_staleness = 0;
        for (k, &r) in rows.iter().enumerate().filter(|(_, r)| **r != EMPTY) {
            self.prefetch_row(rows, k);
            let r = r as usize;
            let version = self.meta[r].version;
            let staleness = staleness(version, read_versions[k]);
            max_staleness = max_staleness.max(staleness);
            let row = &mut self.data[r * self.stride..(r + 1) * self.stride];
            let (params, state) = row.split_at_mut(dim);
            let (s0, s1) = state.split_at_mut(if planes >= 1 { dim } else { 0 });
            let read = if reads.is_empty() { reads } else { &reads[k * dim..(k + 1) * dim] };
            let bufs = Bufs { params, s0, s1, w0: &mut [], grad: &grads[k * dim..(k + 1) * dim], read };
            let scalars = PushScalars { staleness, t: u64::from(version) + 1, ..base };
            gaps_kernels::apply(self.cfg.rule, hyper, &scalars, bufs)?;
            self.meta[r].version = version.wrapping_add(1);
            self.meta[r].touched = now_s;
        }
        Ok(max_staleness)
    }

    /// A push's rows updated where they lie, for a rule whose constants every row shares
    /// ([`Rule::scalars_per_row`] false): the constants derived once ([`gaps_kernels::RowUpdate`]), each row
    /// fetched ahead and updated in place by the vector loops (a 16-float row as one straight-line vector
    /// update) — element for element the same arithmetic as row by row, without copying the rows out and
    /// back. Every row has the same lengths, so the first row's check stands for all: a push the kernels
    /// refuse changes nothing.
    pub(super) fn push_in_place(&mut self, rows: &[u32], push: RowPush<'_>) -> Result<u64, KernelError> {
        let RowPush { grads, reads, read_versions, hyper, base, now_s } = push;
        let dim = self.cfg.dim as usize;
        let planes = self.cfg.rule.layout().shared_planes;
        let update = gaps_kernels::RowUpdate::new(self.cfg.rule, hyper, &PushScalars { staleness: 0, t: 1, ..base });
        let mut max_staleness = 0;
        for (k, &r) in rows.iter().enumerate() {
            self.prefetch_row_at(rows, k + PUSH_AHEAD);
            if r == EMPTY {
                continue;
            }
            let r = r as usize;
            let version = self.meta[r].version;
            max_staleness = max_staleness.max(staleness(version, read_versions[k]));
            let row = &mut self.data[r * self.stride..(r + 1) * self.stride];
            let (params, state) = row.split_at_mut(dim);
            let (s0, s1) = state.split_at_mut(if planes >= 1 { dim } else { 0 });
            let read = if reads.is_empty() { reads } else { &reads[k * dim..(k + 1) * dim] };
            update.apply(Bufs { params, s0, s1, w0: &mut [], grad: &grads[k * dim..(k + 1) * dim], read })?;
            self.meta[r].version = version.wrapping_add(1);
            self.meta[r].touched = now_s;
        }
        Ok(max_staleness)
    }
}
