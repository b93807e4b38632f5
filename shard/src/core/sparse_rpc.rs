//! Sparse pulls and pushes of embedding rows (the tables themselves are [`crate::sparse`]).

use super::*;

impl ShardCore {
    /// Checks a table reference and that every id is owned here; returns the ids.
    pub(super) fn sparse_ids(&self, table: u32, count: u32, words: &[f32]) -> Result<Vec<u64>, ShardError> {
        if table as usize >= self.tables.len() {
            return Err(ShardError::WrongShape(format!("unknown table {table} ({} tables)", self.tables.len())));
        }
        if words.len() < 2 * count as usize {
            return Err(ShardError::WrongShape(format!("{count} ids declared, fewer carried")));
        }
        let ids = words_to_ids(&words[..2 * count as usize]);
        let (me, n) = (self.cfg.shard, self.cfg.num_shards);
        if let Some(id) = ids.iter().find(|id| sparse_owner(table, **id, n) != me) {
            return Err(ShardError::RowNotOwned { table, id: *id, owner: sparse_owner(table, *id, n), me });
        }
        Ok(ids)
    }

    /// Whether table `table` can create `rows` rows without growing its index, metadata or arena (see
    /// [`crate::sparse::SparseTable::has_room_for`]); true for a table that does not exist (the request is
    /// refused before it creates anything).
    pub fn table_has_room_for(&self, table: u32, rows: u64) -> bool {
        self.tables.get(table as usize).is_none_or(|t| t.has_room_for(rows))
    }

    pub(super) fn sparse_pull(&mut self, req: &SparsePull, payload: &[f32], now_s: u32) -> Result<Frame, ShardError> {
        self.check_epoch(req.epoch)?;
        let ids = self.sparse_ids(req.table, req.count, payload)?;
        let table = &mut self.tables[req.table as usize];
        let dim = table.config().dim;
        // The reply is the versions, then the values: the table writes the values straight after room for
        // the versions, which are filled in last (one copy of the rows, not two).
        let n = ids.len();
        let mut out = Vec::with_capacity(n * (1 + dim as usize));
        out.resize(n, 0.0);
        let mut versions = Vec::with_capacity(n);
        if req.create {
            table.pull(&ids, now_s, &mut out, &mut versions);
        } else {
            table.peek(&ids, &mut out, &mut versions);
        }
        if self.gba_reads_ahead() && !self.step.row_accum[req.table as usize].is_empty() {
            self.rows_step_ahead(req.table as usize, &ids, &mut out[n..])?;
        }
        for (slot, version) in out[..n].iter_mut().zip(&versions) {
            *slot = f32::from_bits(*version);
        }
        self.stats.pulls += 1;
        Ok(Frame {
            msg: Message::SparsePullReply(SparsePullReply { table: req.table, count: req.count, dim }),
            payload: out,
        })
    }

    pub(super) fn sparse_push(&mut self, req: &SparsePush, payload: &[f32], now_s: u32) -> Result<Frame, ShardError> {
        if let Some(duplicate) = self.check_push(req.epoch, req.worker, req.seq)? {
            return Ok(duplicate);
        }
        let ids = self.sparse_ids(req.table, req.count, payload)?;
        let (table_rule, hyper) = self.table_rules[req.table as usize];
        let dim = self.tables[req.table as usize].config().dim;
        if req.dim != dim {
            return Err(ShardError::WrongShape(format!(
                "table {} has dim {dim}, the push carries rows of {}",
                req.table, req.dim
            )));
        }
        if req.echo_read != table_rule.layout().needs_read {
            return Err(ShardError::WrongShape(format!(
                "sparse rule {table_rule} {} an echo of the read rows",
                if req.echo_read { "takes no" } else { "needs" }
            )));
        }
        let n = ids.len();
        let rows = n * dim as usize;
        let expected = 3 * n + rows * (1 + usize::from(req.echo_read));
        if payload.len() != expected {
            return Err(ShardError::WrongShape(format!(
                "sparse push carries {} words, expected {expected}",
                payload.len()
            )));
        }
        once_each(&ids, "push; aggregate per id first")?;
        let read_versions: Vec<u32> = payload[2 * n..3 * n].iter().map(|w| w.to_bits()).collect();
        let grads = &payload[3 * n..3 * n + rows];
        let reads = if req.echo_read { &payload[3 * n + rows..] } else { &[][..] };
        for values in [grads, reads] {
            rows_finite(req.table, dim, values)?;
        }
        let max_staleness = if matches!(self.mode.active, Mode::Sync | Mode::Gba) {
            self.accumulate_rows(req, &ids, &read_versions, grads)
        } else {
            let lr = hyper.lr * self.lr.scale;
            let base = PushScalars { lr, lr_max: lr.max(hyper.lr), staleness: 0, t: 1, workers: self.worker_count() };
            self.tables[req.table as usize]
                .push(&ids, &read_versions, grads, reads, &hyper, base, now_s)
                .map_err(|e| ShardError::WrongShape(e.to_string()))?
        };
        self.stats.staleness_max = self.stats.staleness_max.max(max_staleness);
        self.record_applied(req.worker, req.seq);
        Ok(Frame::new(Message::Ack(Ack {
            seq: req.seq,
            max_staleness,
            decisions: self.mode.decisions,
            ..Ack::default()
        })))
    }

    /// gba: the pulled rows the step in progress holds gradients for are read as the step would leave them
    /// were it applied now with what it has (their sums over the step's K gradients), as dense chunks are
    /// ([`ShardCore::step_ahead`]); versions stay the applied ones.
    fn rows_step_ahead(&self, table: usize, ids: &[u64], values: &mut [f32]) -> Result<(), ShardError> {
        let accum = &self.step.row_accum[table];
        let (_, hyper) = self.table_rules[table];
        let rows = &self.tables[table];
        let dim = rows.config().dim as usize;
        let inv = 1.0 / self.gba_k() as f32;
        let lr = hyper.lr * self.lr.scale * self.lr_multiplier() as f32;
        let base = PushScalars { lr, lr_max: lr.max(hyper.lr), staleness: 0, t: 1, workers: self.worker_count() };
        let (mut grad, mut scratch) = (vec![0.0; dim], Vec::new());
        for (k, id) in ids.iter().enumerate() {
            let Some(sum) = accum.get(*id) else { continue };
            grad.iter_mut().zip(sum).for_each(|(g, s)| *g = s * inv);
            rows.preview(*id, &grad, &hyper, base, &mut values[k * dim..(k + 1) * dim], &mut scratch)
                .map_err(|e| ShardError::Device(e.to_string()))?;
        }
        Ok(())
    }

    /// sync and gba: adds a validated sparse push's row gradients to the step's sums, per id, to be applied
    /// once when the step completes (the worker's dense push marks the end of its step). A row read before
    /// the last update it missed is dropped as a dense gradient would be: in sync any staleness, in gba
    /// more than the threshold; rows that do not exist (not admitted, evicted) are dropped and counted.
    /// Returns the largest staleness of a kept row.
    fn accumulate_rows(&mut self, req: &SparsePush, ids: &[u64], read_versions: &[u32], grads: &[f32]) -> u64 {
        let dim = req.dim as usize;
        let bound = if self.mode.active == Mode::Sync { 0 } else { self.cfg.modes.gba_threshold };
        let table = &self.tables[req.table as usize];
        let mut max_staleness = 0u64;
        let (mut stale, mut missing) = (0u64, 0u64);
        for (k, id) in ids.iter().enumerate() {
            let Some(version) = table.version(*id) else {
                missing += 1;
                continue;
            };
            let staleness = u64::from(version.saturating_sub(read_versions[k]));
            if staleness > bound {
                stale += 1;
                continue;
            }
            max_staleness = max_staleness.max(staleness);
            self.step.row_accum[req.table as usize].add(*id, &grads[k * dim..(k + 1) * dim]);
        }
        self.stats.rows_dropped_stale += stale;
        self.tables[req.table as usize].count_dropped(missing);
        max_staleness
    }
}

impl ShardCore {
    /// A page of a table's rows as stored here (an export, [`gaps_common::wire::TableScan`]).
    pub(super) fn table_scan(&self, req: &gaps_common::wire::TableScan) -> Result<Frame, ShardError> {
        self.check_epoch(req.epoch)?;
        let table = self.tables.get(req.table as usize).ok_or_else(|| {
            ShardError::WrongShape(format!("unknown table {} ({} tables)", req.table, self.tables.len()))
        })?;
        // At least one row a page (a cursor always moves), at most MAX_TABLE_PAGE rows and 64 MiB.
        let row_bytes = 4 * (2 + table.config().dim as usize);
        let max = (req.max_rows.min(gaps_common::wire::MAX_TABLE_PAGE) as usize).min((64 << 20) / row_bytes).max(1);
        let (mut ids, mut values) = (Vec::new(), Vec::new());
        let next = table.scan(usize::try_from(req.cursor).unwrap_or(usize::MAX), max, &mut ids, &mut values);
        let mut payload = Vec::with_capacity(2 * ids.len() + values.len());
        gaps_common::wire::ids_to_words(&ids, &mut payload);
        payload.extend_from_slice(&values);
        let dim = table.config().dim;
        Ok(Frame {
            msg: Message::TableRows(gaps_common::wire::TableRows {
                table: req.table,
                count: ids.len() as u32,
                dim,
                next: next.map(|n| n as u64),
            }),
            payload,
        })
    }

    /// Loads rows into a table (an import, [`gaps_common::wire::TableLoad`]): every id must be this shard's,
    /// appear once and carry finite values; checked whole before any row is loaded. A held row is kept.
    pub(super) fn table_load(
        &mut self,
        req: &gaps_common::wire::TableLoad,
        payload: &[f32],
        now_s: u32,
    ) -> Result<Frame, ShardError> {
        self.check_epoch(req.epoch)?;
        if req.count > gaps_common::wire::MAX_TABLE_PAGE {
            return Err(ShardError::WrongShape(format!(
                "a load carries at most {} rows, not {}",
                gaps_common::wire::MAX_TABLE_PAGE,
                req.count
            )));
        }
        let ids = self.sparse_ids(req.table, req.count, payload)?;
        let dim = self.tables[req.table as usize].config().dim;
        if req.dim != dim {
            return Err(ShardError::WrongShape(format!(
                "table {} has dim {dim}, the load carries {}",
                req.table, req.dim
            )));
        }
        let n = ids.len();
        if payload.len() != n * (2 + dim as usize) {
            return Err(ShardError::WrongShape(format!(
                "a load of {n} rows of {dim} carries {} words, expected {}",
                payload.len(),
                n * (2 + dim as usize)
            )));
        }
        once_each(&ids, "load")?;
        let values = &payload[2 * n..];
        rows_finite(req.table, dim, values)?;
        let table = &mut self.tables[req.table as usize];
        let (mut created, mut kept) = (0u32, 0u32);
        for (k, id) in ids.iter().enumerate() {
            if table.load(*id, &values[k * dim as usize..(k + 1) * dim as usize], now_s) {
                created += 1;
            } else {
                kept += 1;
            }
        }
        table.fit_budget();
        Ok(Frame::new(Message::TableLoaded(gaps_common::wire::TableLoaded { created, kept })))
    }
}

/// Refuses ids that appear more than once in one request (`what` says which).
fn once_each(ids: &[u64], what: &str) -> Result<(), ShardError> {
    // Sorted, not hashed: no set to allocate and no hashing per id (measured no slower at 4,096 ids).
    let mut sorted = ids.to_vec();
    sorted.sort_unstable();
    match sorted.windows(2).find(|pair| pair[0] == pair[1]) {
        Some(pair) => Err(ShardError::WrongShape(format!("id {} appears twice in one {what}", pair[0]))),
        None => Ok(()),
    }
}

/// Refuses rows of `dim` floats of `table` holding NaN or ±∞, naming the row and element.
fn rows_finite(table: u32, dim: u32, values: &[f32]) -> Result<(), ShardError> {
    match gaps_common::dtype::first_non_finite(values) {
        Some(index) => Err(ShardError::NonFinite {
            tensor: table,
            chunk: (index / dim as usize) as u32,
            index: index % dim as usize,
            value: values[index].to_string(),
        }),
        None => Ok(()),
    }
}
