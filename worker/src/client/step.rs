//! A worker's whole step in one request per shard ([`Message::Step`]): its rows' gradients, its dense
//! push answered with the next dense values, and its next batch's rows.

use super::dense::recycle_grads;
use super::*;
use gaps_common::wire::{SparsePullReply, Step};

/// What a step brought back: the acks, the next dense values and the next batch's rows.
#[derive(Debug)]
pub struct StepOutcome {
    /// The shards' acknowledgements (dense pushes and row pushes).
    pub summary: PushSummary,
    /// The dense values to compute the next step on.
    pub dense: Snapshot,
    /// The next batch's rows, where the step was given its ids.
    pub rows: Option<SparseRows>,
}

/// Where a shard's answer to a step goes: the dense values into the snapshot's tensors, the next rows into
/// their own buffer (a version word per row, then the rows).
struct StepInto<'a> {
    dense: PullInto<'a>,
    /// (table, rows asked for, floats per row).
    asked: Option<(u32, usize, usize)>,
    rows: Vec<f32>,
    got_rows: bool,
}

impl net::ReplySink for StepInto<'_> {
    /// As `PullInto`'s: neither the dense values nor the rows of a cut-off reply are there.
    fn begin(&mut self) {
        self.dense.begin();
        self.got_rows = false;
    }

    fn destination<'s>(&'s mut self, msg: &Message) -> Result<Option<Vec<&'s mut [f32]>>, String> {
        let Message::StepReply(reply) = msg else {
            return Err(format!("a {} message answered a step", net::kind_name(msg)));
        };
        let mut dest: Vec<&'s mut [f32]> = Vec::new();
        // Values come for every chunk asked for, or for none (the worker waits, or pulls itself).
        if !reply.push.chunks.is_empty() || self.dense.expected.is_empty() {
            self.dense.accept(&reply.push.chunks)?;
            dest.extend(self.dense.slices.iter_mut().map(|s| &mut **s));
        }
        if let Some(SparsePullReply { table, count, dim }) = reply.next_rows {
            match self.asked {
                Some((t, n, d)) if t == table && n == count as usize && d == dim as usize => {
                    self.rows.resize(n * (1 + d), 0.0);
                    self.got_rows = true;
                    dest.push(&mut self.rows);
                }
                _ => return Err(format!("{count} rows of {dim} floats of table {table} answered rows not asked for")),
            }
        }
        Ok(Some(dest))
    }
}

impl Client {
    /// A worker's step ([`Message::Step`], one request and one reply per shard): the gradients `row_grads` of
    /// the rows `rows` of `table`, the dense gradients `grads` computed on `snapshot` (as
    /// [`Self::push_pull`]), and the rows `next_ids` of the next batch, read after the push. Returns the
    /// acks, the next dense values and the next rows (a step held for a synchronous step or a GBA hold is
    /// answered with both once released). Where a shard answers without them (the worker is to wait for the
    /// step itself), the worker waits as a push-pull does and pulls what is missing; a push striped over
    /// several connections goes as separate requests.
    pub async fn step(
        &self,
        grads: Vec<Vec<f32>>,
        snapshot: &Snapshot,
        (table, rows, row_grads): (u32, &SparseRows, &[f32]),
        next_ids: Option<&[u64]>,
    ) -> Result<StepOutcome, ClientError> {
        self.check_sparse_push(table, rows, row_grads)?;
        let mut grads = Arc::new(grads);
        let pushes = self.dense_pushes(&mut grads, snapshot)?;
        if pushes.iter().any(|(_, _, stripes)| stripes.len() > 1) {
            let (rows_pushed, dense) =
                tokio::join!(self.push_sparse(table, rows, row_grads), self.send_pushes(pushes, grads, true));
            rows_pushed?;
            let (summary, next) = dense?;
            let dense = match next {
                Some(next) => next,
                None => self.pull().await?,
            };
            let rows = match next_ids {
                Some(ids) => Some(self.pull_sparse(table, ids, true).await?),
                None => None,
            };
            return Ok(StepOutcome { summary, dense, rows });
        }
        let worker = self.worker_for("push")?;
        let row_groups = self.by_shard(table, &rows.ids);
        let next_groups = next_ids.map(|ids| self.by_shard(table, ids));
        let dim = rows.dim;
        // Each shard's request, made here from the borrowed rows and ids: (shard, message, payload, the
        // rows it is asked for).
        let requests: Vec<(usize, Message, Vec<net::Bytes>, usize)> = pushes
            .into_iter()
            .map(|(s, push, stripes)| {
                let mut payload = Vec::with_capacity(2 + stripes.iter().map(|(_, p)| p.len()).sum::<usize>());
                let row_push = (!row_groups[s].is_empty()).then(|| {
                    let (header, values) = self.sparse_push_to(s, worker, table, (rows, row_grads), &row_groups[s]);
                    payload.push(net::f32_bytes(values));
                    header
                });
                payload.extend(stripes.into_iter().flat_map(|(_, p)| p));
                let (next_rows, count) = match (next_ids, &next_groups) {
                    (Some(ids), Some(groups)) if !groups[s].is_empty() => {
                        let mut words = Vec::with_capacity(2 * groups[s].len());
                        ids_to_words(&groups[s].iter().map(|k| ids[*k]).collect::<Vec<_>>(), &mut words);
                        payload.push(net::f32_bytes(words));
                        let count = groups[s].len() as u32;
                        (Some(SparsePull { epoch: self.inner.map.epoch, table, count, create: true }), count)
                    }
                    _ => (None, 0),
                };
                (s, Message::Step(Step { rows: row_push, push, next_rows }), payload, count as usize)
            })
            .collect();
        let client = self.clone();
        let exchange = async move { client.step_exchange(requests, grads, (table, dim)).await };
        let (summary, dense, rows_of) = on_runtime("step", exchange).await?;
        let rows = match (next_ids, next_groups) {
            (Some(ids), Some(groups)) => Some(self.gather_rows(table, ids, &groups, rows_of, dim).await?),
            _ => None,
        };
        Ok(StepOutcome { summary, dense, rows })
    }

    /// The requests of a step (see [`Self::step`]) sent and answered: the acks, the next dense values
    /// (pulled here where a shard did not send them) and each shard's rows where it sent them.
    async fn step_exchange(
        &self,
        requests: Vec<(usize, Message, Vec<net::Bytes>, usize)>,
        grads: Arc<Vec<Vec<f32>>>,
        (table, dim): (u32, usize),
    ) -> Result<(PushSummary, Snapshot, Vec<Option<Vec<f32>>>), ClientError> {
        let mut tensors = self.snapshot_buffers();
        let (sinks, requests_of) = self.pull_sinks(&mut tensors, Some(1))?;
        let mut sinks: Vec<StepInto<'_>> = sinks
            .into_iter()
            .zip(&requests)
            .map(|(dense, (_, _, _, count))| StepInto {
                dense,
                asked: (*count > 0).then_some((table, *count, dim)),
                rows: Vec::new(),
                got_rows: false,
            })
            .collect();
        let after_rows = self.inner.synchronous();
        let sent = sinks.iter_mut().zip(requests).map(|(sink, (s, msg, payload, _))| async move {
            if after_rows {
                self.inner.shards[s].sparse_settled().await;
            }
            (s, self.request_with(s, &msg, &payload, sink).await)
        });
        let mut summary = PushSummary::default();
        let mut waits = Vec::new();
        for (s, outcome) in join_all(sent.collect()).await {
            if let Ok((Frame { msg: Message::StepReply(StepReply { rows: Some(ack), .. }), .. }, _)) = &outcome {
                self.count_ack(s, ack, &mut summary);
            }
            self.take_ack(s, outcome, &mut summary, &mut waits)?;
        }
        let filled = waits.is_empty() && sinks.iter().all(|sink| sink.dense.filled);
        let versions = filled.then(|| self.pulled_versions(sinks.iter().map(|s| &s.dense), &requests_of));
        // The next rows, put in the order of `next_ids` by the caller; those of shards that did not send
        // them are pulled there.
        let rows_of: Vec<Option<Vec<f32>>> = sinks.into_iter().map(|sink| sink.got_rows.then_some(sink.rows)).collect();
        recycle_grads(grads);
        self.wait_all(waits).await?;
        let dense = match versions {
            Some(versions) => self.pulled_snapshot(tensors, versions),
            None => {
                tensors.into_iter().for_each(gaps_common::buffers::give);
                self.pull().await?
            }
        };
        Ok((summary, dense, rows_of))
    }

    /// The rows `ids` of `table` from the shards' answers (`rows_of[s]`: versions, then values, of the ids
    /// at `groups[s]`), those of the shards that sent none pulled now.
    async fn gather_rows(
        &self,
        table: u32,
        ids: &[u64],
        groups: &[Vec<usize>],
        rows_of: Vec<Option<Vec<f32>>>,
        dim: usize,
    ) -> Result<SparseRows, ClientError> {
        let missing: Vec<usize> = groups
            .iter()
            .zip(&rows_of)
            .filter(|(g, r)| !g.is_empty() && r.is_none())
            .flat_map(|(g, _)| g.iter().copied())
            .collect();
        let mut values = vec![0.0f32; ids.len() * dim];
        let mut versions = vec![0u32; ids.len()];
        for (positions, rows) in groups.iter().zip(rows_of) {
            let Some(rows) = rows else { continue };
            let (vers, vals) = rows.split_at(positions.len());
            for (i, k) in positions.iter().enumerate() {
                versions[*k] = vers[i].to_bits();
                values[k * dim..(k + 1) * dim].copy_from_slice(&vals[i * dim..(i + 1) * dim]);
            }
        }
        if !missing.is_empty() {
            let pulled = self.pull_sparse(table, &missing.iter().map(|k| ids[*k]).collect::<Vec<_>>(), true).await?;
            for (i, k) in missing.iter().enumerate() {
                versions[*k] = pulled.versions[i];
                values[k * dim..(k + 1) * dim].copy_from_slice(&pulled.values[i * dim..(i + 1) * dim]);
            }
        }
        Ok(SparseRows { ids: ids.to_vec(), values, versions, dim })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use net::ReplySink;

    #[test]
    fn a_step_sink_forgets_at_each_call_what_an_earlier_reply_promised() {
        let mut sink = StepInto {
            dense: PullInto::new(Vec::new(), Vec::new()),
            asked: Some((0, 2, 3)),
            rows: Vec::new(),
            got_rows: false,
        };
        let reply = Message::StepReply(StepReply {
            rows: None,
            push: PushPullReply { ack: Default::default(), chunks: Vec::new() },
            next_rows: Some(SparsePullReply { table: 0, count: 2, dim: 3 }),
        });
        assert!(sink.destination(&reply).expect("rows asked for").is_some());
        assert!(sink.dense.filled && sink.got_rows, "no dense chunk was asked for; the rows have a destination");
        sink.begin();
        assert!(!sink.dense.filled && !sink.got_rows, "a new call: nothing of the last reply is counted on");
    }
}
