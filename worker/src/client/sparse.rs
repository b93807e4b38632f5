//! Embedding tables: rows pulled and pushed by id, each on the shard that owns it, and tables exported
//! and imported a page at a time.

use super::*;

impl Client {
    pub(super) fn table_dim(&self, table: u32) -> Result<usize, ClientError> {
        self.inner
            .map
            .layout
            .tables
            .get(table as usize)
            .map(|t| t.dim as usize)
            .ok_or_else(|| ClientError::Shape(format!("the model has no sparse table {table}")))
    }

    /// Groups positions of `ids` by owning shard.
    pub(super) fn by_shard(&self, table: u32, ids: &[u64]) -> Vec<Vec<usize>> {
        let n = self.inner.map.num_shards;
        let mut groups = vec![Vec::new(); n as usize];
        for (k, id) in ids.iter().enumerate() {
            groups[sparse_owner(table, *id, n) as usize].push(k);
        }
        groups
    }

    /// Pulls rows of a sparse table from their shards concurrently. `create` makes missing rows (training);
    /// without it missing rows read their initial values and nothing is stored (evaluation).
    pub async fn pull_sparse(&self, table: u32, ids: &[u64], create: bool) -> Result<SparseRows, ClientError> {
        let dim = self.table_dim(table)?;
        let groups = self.by_shard(table, ids);
        let mut tasks = tokio::task::JoinSet::new();
        for (s, positions) in groups.iter().enumerate() {
            if positions.is_empty() {
                continue;
            }
            let mut words = Vec::with_capacity(2 * positions.len());
            ids_to_words(&positions.iter().map(|k| ids[*k]).collect::<Vec<_>>(), &mut words);
            let msg = Message::SparsePull(SparsePull {
                epoch: self.inner.map.epoch,
                table,
                count: positions.len() as u32,
                create,
            });
            let client = self.clone();
            let words = [net::f32_bytes(words)];
            tasks.spawn(async move { client.request(s, &msg, &words).await.map(|(frame, _)| (s, frame)) });
        }
        let n = ids.len();
        let (values, versions) = on_runtime("sparse pull", async move {
            let mut values = vec![0.0f32; n * dim];
            let mut versions = vec![0u32; n];
            while let Some(joined) = tasks.join_next().await {
                let (s, frame) = joined.map_err(|e| ClientError::Shape(format!("sparse pull task failed: {e}")))??;
                let positions = &groups[s];
                let ok = match &frame.msg {
                    Message::SparsePullReply(r) => r.count as usize == positions.len() && r.dim as usize == dim,
                    _ => false,
                };
                if !ok || frame.payload.len() != positions.len() * (1 + dim) {
                    return Err(ClientError::BadMap(format!(
                        "shard {s} answered a sparse pull with {:?}",
                        net::kind_name(&frame.msg)
                    )));
                }
                let (vers, rows) = frame.payload.split_at(positions.len());
                for (i, k) in positions.iter().enumerate() {
                    versions[*k] = vers[i].to_bits();
                    values[k * dim..(k + 1) * dim].copy_from_slice(&rows[i * dim..(i + 1) * dim]);
                }
            }
            Ok((values, versions))
        })
        .await?;
        Ok(SparseRows { ids: ids.to_vec(), values, versions, dim })
    }

    /// Pushes gradients of distinct rows (`grads` is `rows.ids.len() × dim`, computed on `rows`) to their
    /// shards concurrently, exactly once per shard like dense pushes.
    pub async fn push_sparse(&self, table: u32, rows: &SparseRows, grads: &[f32]) -> Result<PushSummary, ClientError> {
        let worker = self.worker_for("push")?;
        self.check_sparse_push(table, rows, grads)?;
        let groups = self.by_shard(table, &rows.ids);
        let mut tasks = tokio::task::JoinSet::new();
        for (s, positions) in groups.iter().enumerate() {
            if positions.is_empty() {
                continue;
            }
            let (push, payload) = self.sparse_push_to(s, worker, table, (rows, grads), positions);
            let msg = Message::SparsePush(push);
            let client = self.clone();
            let payload = [net::f32_bytes(payload)];
            self.inner.shards[s].sparse_in_flight.fetch_add(1, Ordering::SeqCst);
            tasks.spawn(async move {
                let _in_flight = InFlight(&client.inner.shards[s]);
                client.request(s, &msg, &payload).await.map(|answer| (s, answer))
            });
        }
        let client = self.clone();
        on_runtime("sparse push", async move {
            let mut summary = PushSummary::default();
            while let Some(joined) = tasks.join_next().await {
                let (s, (frame, retries)) =
                    joined.map_err(|e| ClientError::Shape(format!("sparse push task failed: {e}")))??;
                summary.retries += retries;
                match frame.msg {
                    Message::Ack(ack) => client.count_ack(s, &ack, &mut summary),
                    other => {
                        return Err(
                            RpcError::Unexpected { addr: "shard".into(), kind: net::kind_name(&other).into() }.into()
                        )
                    }
                }
            }
            Ok(summary)
        })
        .await
    }

    /// Shard `s`'s part of a sparse push of `worker` (the rows at `positions` of `rows`, their gradients in
    /// `grads`, checked by the caller), with the shard's next sequence number: its header and payload (ids,
    /// versions read, gradients, and the rows read where the table's rule needs them).
    pub(super) fn sparse_push_to(
        &self,
        s: usize,
        worker: u32,
        table: u32,
        (rows, grads): (&SparseRows, &[f32]),
        positions: &[usize],
    ) -> (SparsePush, Vec<f32>) {
        let dim = rows.dim;
        let echo = self.inner.table_rules.get(table as usize).is_some_and(|r| r.layout().needs_read);
        let mut payload = Vec::with_capacity(positions.len() * (3 + dim * (1 + usize::from(echo))));
        ids_to_words(&positions.iter().map(|k| rows.ids[*k]).collect::<Vec<_>>(), &mut payload);
        payload.extend(positions.iter().map(|k| f32::from_bits(rows.versions[*k])));
        for k in positions {
            payload.extend_from_slice(&grads[k * dim..(k + 1) * dim]);
        }
        if echo {
            for k in positions {
                payload.extend_from_slice(&rows.values[k * dim..(k + 1) * dim]);
            }
        }
        let seq = self.inner.shards[s].next_seq.fetch_add(1, Ordering::SeqCst);
        self.inner.pushes_sent.fetch_add(1, Ordering::Relaxed);
        let count = positions.len() as u32;
        (
            SparsePush { epoch: self.inner.map.epoch, worker, seq, table, count, dim: dim as u32, echo_read: echo },
            payload,
        )
    }

    /// The checks of a sparse push before anything is sent: `grads` finite and shaped as `rows` of `table`.
    pub(super) fn check_sparse_push(&self, table: u32, rows: &SparseRows, grads: &[f32]) -> Result<(), ClientError> {
        let dim = self.table_dim(table)?;
        let name = self.inner.map.layout.tables.get(table as usize).map_or("?", |t| t.name.as_str());
        check_finite(&format!("the row gradients of table {name:?} ({table})"), grads)?;
        if rows.dim != dim || grads.len() != rows.ids.len() * dim || rows.values.len() != grads.len() {
            return Err(ClientError::Shape("sparse gradients do not match the pulled rows".into()));
        }
        Ok(())
    }

    /// One page of `table`'s rows as shard `s` stores them, from `cursor` (0 first): (ids, `ids × dim`
    /// values, the next page's cursor or None after the last). An export walks every shard's pages.
    pub async fn table_page(
        &self,
        s: usize,
        table: u32,
        cursor: u64,
        max_rows: u32,
    ) -> Result<(Vec<u64>, Vec<f32>, Option<u64>), ClientError> {
        let dim = self.table_dim(table)?;
        if s >= self.inner.shards.len() {
            return Err(ClientError::Shape(format!("no shard {s} ({} shards)", self.inner.shards.len())));
        }
        let msg =
            Message::TableScan(gaps_common::wire::TableScan { epoch: self.inner.map.epoch, table, cursor, max_rows });
        let (frame, _) = self.request(s, &msg, &[]).await?;
        let addr = self.inner.shards[s].addr().to_string();
        let Message::TableRows(rows) = frame.msg else {
            return Err(RpcError::Unexpected { addr, kind: net::kind_name(&frame.msg).into() }.into());
        };
        let n = rows.count as usize;
        if rows.dim as usize != dim || frame.payload.len() != n * (2 + dim) {
            return Err(RpcError::BadReply {
                addr,
                message: format!("a page of {n} rows of {dim} floats was expected"),
            }
            .into());
        }
        let ids = gaps_common::wire::words_to_ids(&frame.payload[..2 * n]);
        Ok((ids, frame.payload[2 * n..].to_vec(), rows.next))
    }

    /// Loads rows into `table` (an import): `values` holds `ids × dim` floats; each id goes to the shard that
    /// owns it, in pages. A row a shard holds already keeps its values. Returns (rows created, rows kept).
    pub async fn load_rows(&self, table: u32, ids: &[u64], values: &[f32]) -> Result<(u32, u32), ClientError> {
        let worker = self.worker_for("load rows")?;
        let dim = self.table_dim(table)?;
        if values.len() != ids.len() * dim {
            return Err(ClientError::Shape(format!(
                "{} ids need {} values, got {}",
                ids.len(),
                ids.len() * dim,
                values.len()
            )));
        }
        check_finite("the rows loaded", values)?;
        let mut distinct = std::collections::HashSet::with_capacity(ids.len());
        if let Some(id) = ids.iter().find(|id| !distinct.insert(**id)) {
            return Err(ClientError::Shape(format!("id {id} appears twice in the rows loaded")));
        }
        let (mut created, mut kept) = (0, 0);
        for (s, positions) in self.by_shard(table, ids).iter().enumerate() {
            for page in positions.chunks(gaps_common::wire::MAX_TABLE_PAGE as usize) {
                let mut payload = Vec::with_capacity(page.len() * (2 + dim));
                ids_to_words(&page.iter().map(|k| ids[*k]).collect::<Vec<_>>(), &mut payload);
                for k in page {
                    payload.extend_from_slice(&values[k * dim..(k + 1) * dim]);
                }
                let msg = Message::TableLoad(gaps_common::wire::TableLoad {
                    epoch: self.inner.map.epoch,
                    worker,
                    table,
                    count: page.len() as u32,
                    dim: dim as u32,
                });
                let (c, k) = self.load(s, &msg, payload).await?;
                (created, kept) = (created + c, kept + k);
            }
        }
        Ok((created, kept))
    }
}
