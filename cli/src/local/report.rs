//! What a local run reports: [`LocalReport`] and the JSON summary it prints ([`LocalSummary`]), the
//! replication, data and CTR parts, and the figures computed from the shards' counters.

use super::*;

/// The final report of a local run.
#[derive(Debug, Clone, PartialEq)]
pub struct LocalReport {
    /// Flags as given.
    pub servers: u32,
    /// Flags as given.
    pub workers: u32,
    /// Steps, pushes, staleness, mode switches, restarts: what the workers and shards counted.
    pub counters: RunCounters,
    /// The CTR figures (CTR models only).
    pub ctr: Option<CtrReport>,
    /// The cluster's mode switches as the coordinator decided them, with their reasons.
    pub switches: Vec<gaps_common::wire::ModeSwitchRecord>,
    /// Dynamic data sharding: the dealer's account at the end (None: static shares).
    pub data: Option<DataReport>,
    /// Replicated shards (`--replicas` ≥ 2): the coordinator's replica sets at the end.
    pub replication: Option<ReplicationReport>,
}

/// The run's counters: in [`LocalReport`] and, as they are, in [`LocalSummary`] (`gaps local --json`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct RunCounters {
    /// Held-out log-loss of the initial model (null in JSON if not a number).
    #[serde(deserialize_with = "crate::reports::nan_if_null_f32")]
    pub initial_loss: f32,
    /// Held-out log-loss of the final model (null in JSON if not a number).
    #[serde(deserialize_with = "crate::reports::nan_if_null_f32")]
    pub final_loss: f32,
    /// Worker steps in total.
    pub steps: u64,
    /// Shard pushes sent by all workers (each once).
    pub pushes_sent: u64,
    /// Shard pushes applied by all shards.
    pub pushes_applied: u64,
    /// Retried pushes acknowledged as duplicates.
    pub pushes_duplicate: u64,
    /// Requests workers resent after transport failures.
    pub retries: u64,
    /// Mean staleness of applied chunk updates.
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub staleness_mean: f64,
    /// Largest staleness.
    pub staleness_max: u64,
    /// Wall-clock seconds, first process started to last process stopped.
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub wall_s: f64,
    /// Mode switches (shard 0).
    pub mode_switches: u64,
    /// Every shard carried out the same switches at the same worker steps (as far as each remembers;
    /// a restarted shard only those since its restart).
    pub switches_agree: bool,
    /// Synchronous steps (shard 0).
    pub steps_sync: u64,
    /// GBA steps (shard 0).
    pub steps_gba: u64,
    /// Workers that finished their training (started + added − killed).
    pub workers_final: u32,
    /// Gradients dropped as too stale, all shards.
    pub dropped_stale: u64,
    /// The learning-rate multiplier at the end (shard 0).
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub lr_multiplier_final: f64,
    /// Shards restarted (from their checkpoints).
    pub shard_restarts: u32,
    /// Checkpoints the shards wrote (counted from the files as they appear).
    pub checkpoints_written: u64,
    /// The largest tensor version a restarted shard came back at (0 without restarts).
    pub restored_version: u64,
    /// Shard pushes the workers saw acknowledged.
    pub pushes_acknowledged: u64,
    /// Acknowledged pushes a crash lost (applied by a shard after the checkpoint it returned to): per worker
    /// and shard, the pushes the worker saw acknowledged beyond those the shard's state holds of it (the
    /// shard's own per-worker ledger, [`gaps_common::wire::Stats::applied_by_worker`]).
    pub pushes_lost: u64,
    /// Pushes a shard applied although its ledger held them already (0 unless exactly-once failed).
    pub pushes_applied_twice: u64,
    /// Gradients a restored shard refused because they were computed before its restore.
    pub stale_after_restore: u64,
    /// Pushes a killed worker may have sent in the step it was killed in, without seeing them acknowledged
    /// (at most one step's pushes per killed worker; each was applied once or not at all). The books:
    /// `pushes_acknowledged ≤ pushes_applied + pushes_lost ≤ pushes_acknowledged + pushes_unconfirmed`,
    /// with equality on the left when no worker was killed.
    pub pushes_unconfirmed: u64,
    /// The longest time any worker took between two of its steps, seconds (a step's own time, or a stall:
    /// a dead shard, a fail-over, a straggler held for).
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub longest_step_s: f64,
    /// Gradients dropped at mode switches (computed in the mode before, too stale for the new), all shards.
    pub pushes_dropped_at_switch: u64,
}

/// Who held each shard at the end of a replicated run, as the coordinator's map says.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ReplicationReport {
    /// Take-overs of a shard by a backup, all shards (the sum of the shards' replica epochs).
    pub failovers: u64,
    /// Per shard, the process serving it (its own index unless a backup took it over).
    pub serving: Vec<u32>,
    /// Per shard, the processes whose copy is in sync (replies wait for them) as the coordinator knows them:
    /// a process killed and restarted empty appears here again once it caught up. For shard 0, those of the
    /// configuration a majority chose last; null where no majority chooses it (fewer than 3 processes: its
    /// copies are not reported to the coordinator, its log says when they catch up).
    pub backups_in_sync: Vec<Option<Vec<u32>>>,
    /// Processes that serve no shard (theirs was taken over while they were down) and keep copies.
    pub spare_processes: Vec<u32>,
    /// Per shard killed (`--kill-shard`, in kill order; shard 0 where a majority chooses who serves it):
    /// seconds from the SIGKILL until the coordinator's map showed a backup serving it (null: not within a
    /// minute).
    pub failover_s: Vec<Option<f64>>,
    /// Per shard, as its serving process reports it at the end: the most log entries its slowest in-sync
    /// backup (one replies wait for) was behind, since that process started serving ([`Stats::replica_lag_peak`]).
    ///
    /// [`Stats::replica_lag_peak`]: gaps_common::wire::Stats::replica_lag_peak
    pub replica_lag_peak: Vec<u64>,
    /// Per shard, as its serving process reports it at the end: how it copied the shard to each backup since
    /// it started serving it (re-replication: snapshots, bytes, the longest pause of the core to take one,
    /// the longest until the backup caught up; [`Stats::replica_copies`]).
    ///
    /// [`Stats::replica_copies`]: gaps_common::wire::Stats::replica_copies
    pub rereplication: Vec<Vec<CopyReport>>,
}

/// One backup's copies of a shard (see [`ReplicationReport::rereplication`]).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct CopyReport {
    /// The backup's shard process.
    pub backup: u32,
    /// Snapshots taken for it, and their bytes sent.
    pub snapshots: u64,
    pub bytes: u64,
    /// Whether replies waited for it at the end (it had caught up).
    pub live: bool,
    /// Bytes of a snapshot still being sent at the end (0: none).
    pub bytes_left: u64,
    /// The longest pause of the shard's core to take a snapshot for it, and the longest from a snapshot to
    /// the backup counting, in seconds.
    pub pause_peak_s: f64,
    pub catch_up_peak_s: f64,
}

impl CopyReport {
    pub(super) fn of(c: &gaps_common::wire::ReplicaCopy) -> Self {
        CopyReport {
            backup: c.backup,
            snapshots: c.snapshots,
            bytes: c.bytes_sent,
            live: c.live,
            bytes_left: c.copying_total.saturating_sub(c.copying_sent),
            pause_peak_s: c.pause_peak_us as f64 / 1e6,
            catch_up_peak_s: c.catch_up_peak_ms as f64 / 1e3,
        }
    }
}

impl ReplicationReport {
    /// The report of a cluster map.
    pub fn from_map(map: &gaps_common::wire::ClusterMap) -> Self {
        ReplicationReport {
            failovers: map.shards.iter().map(|s| s.epoch).sum(),
            serving: map.shards.iter().map(|s| s.process).collect(),
            // Shard 0's are listed where a majority of 3 or more processes chooses them.
            backups_in_sync: map
                .shards
                .iter()
                .map(|s| (s.index != 0 || (map.replicas >= 2 && map.num_shards >= 3)).then(|| s.backups.clone()))
                .collect(),
            spare_processes: map.spare.iter().map(|s| s.index).collect(),
            failover_s: Vec::new(),
            replica_lag_peak: Vec::new(),
            rereplication: Vec::new(),
        }
    }
}

/// What the coordinator's dealer did (dynamic data sharding); in [`LocalSummary`] as it is, `finished`
/// named `data_finished`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct DataReport {
    /// Splits finished, all epochs together.
    pub splits_done: u64,
    /// Splits in one pass over the data (0: synthetic data).
    pub splits_per_epoch: u64,
    /// Splits given back unfinished (dead, departed or rolled-back holders) and dealt again.
    pub splits_returned: u64,
    /// Splits still waiting to be dealt again when the run ended.
    pub splits_pending: u64,
    /// Samples trained under grants that did not finish (trained again in the split's next deal).
    pub samples_replayed: u64,
    /// Every pass dealt and finished.
    #[serde(rename = "data_finished")]
    pub finished: bool,
}

/// The shards' data status (`--data-status-out`): `{"shards":[{"shard","counts":[[grant,split,samples]…],
/// "counts_evicted","dealer":{…,"completed":[[grant,split]…],"abandoned":[grant…],"leased":[[grant,split,
/// worker]…]}}…]}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DataStatusFile {
    /// One entry per shard.
    pub shards: Vec<ShardDataStatus>,
}

/// One shard's data status.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardDataStatus {
    pub shard: u32,
    /// Samples trained per (grant, split).
    pub counts: Vec<[u64; 3]>,
    pub counts_evicted: u64,
    /// The coordinator's dealer (shard 0 only).
    pub dealer: Option<DealerStatus>,
}

/// The dealer's state in [`ShardDataStatus`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DealerStatus {
    pub data_epoch: u64,
    pub splits_per_epoch: u64,
    pub splits_done: u64,
    pub splits_returned: u64,
    pub splits_pending: u64,
    pub samples_replayed: u64,
    pub finished: bool,
    /// (grant, split) of every finished split.
    pub completed: Vec<[u64; 2]>,
    /// Grants given up.
    pub abandoned: Vec<u64>,
    /// (grant, split, worker) of every lease.
    pub leased: Vec<[u64; 3]>,
}

/// Writes the shards' data status as JSON: [`DataStatusFile`].
pub(super) fn write_data_status(path: &std::path::Path, status: &[gaps_common::wire::DataStatus]) -> Result<()> {
    let shards = status
        .iter()
        .map(|s| ShardDataStatus {
            shard: s.shard,
            counts: s.counts.iter().map(|c| [c.grant, c.split, c.samples]).collect(),
            counts_evicted: s.counts_evicted,
            dealer: s.dealer.as_ref().map(|d| DealerStatus {
                data_epoch: d.data_epoch,
                splits_per_epoch: d.splits_per_epoch,
                splits_done: d.splits_done,
                splits_returned: d.splits_returned,
                splits_pending: d.splits_pending,
                samples_replayed: d.samples_replayed,
                finished: d.finished,
                completed: d.completed.iter().map(|(g, k)| [*g, *k]).collect(),
                abandoned: d.abandoned.clone(),
                leased: d.leased.iter().map(|l| [l.grant, l.split, u64::from(l.worker)]).collect(),
            }),
        })
        .collect();
    let text = serde_json::to_string(&DataStatusFile { shards }).context("encoding the data status")?;
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// What the CTR models add to the report.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CtrReport {
    /// Held-out AUC.
    pub auc: f64,
    /// AUC of the planted teacher on the same samples (synthetic data only).
    pub teacher_auc: Option<f64>,
    /// Held-out log-loss.
    pub logloss: f64,
    /// Training samples per second over all workers.
    pub samples_per_s: f64,
    /// Bad lines in the data file.
    pub bad_lines: u64,
    /// Embedding rows held by all shards.
    pub table_rows: u64,
    /// Bytes held by all shards' tables.
    pub table_bytes: u64,
    /// Passes over the data file (the furthest worker; 0 for synthetic data).
    pub epochs: f64,
    /// The held-out log-loss of the best constant predictor (the held-out click rate).
    pub constant_logloss: f64,
    /// Embedding-row gradients dropped as too stale in sync or gba, all shards.
    pub rows_dropped_stale: u64,
    /// Worker 0's held-out evaluations (`--eval-every`): (step, epochs, log-loss, AUC).
    pub heldout_curve: Vec<(u64, f64, f64, f64)>,
    /// Workers that stopped early (`--patience`).
    pub stopped_early: u32,
    /// The observer's evaluations during training (`--eval-interval`) and the final one: (seconds since
    /// training started, AUC, log-loss).
    pub timeline: Vec<(f64, f64, f64)>,
}

/// `gaps local --json`'s summary line: the run's [`LocalReport`] with the flags that shaped it. The data
/// dealer's fields are present with dynamic data sharding, the CTR fields with the CTR models.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LocalSummary {
    /// Shards.
    pub servers: u32,
    /// Workers at the start.
    pub workers: u32,
    /// `--model`.
    pub model: String,
    /// The dense rule.
    pub rule: String,
    /// See [`RunCounters`].
    #[serde(flatten)]
    pub counters: RunCounters,
    /// `--mode`.
    pub mode: String,
    /// `--wire-dtype`.
    pub wire_dtype: String,
    /// The coordinator's mode switches.
    pub switches: Vec<SwitchSummary>,
    /// `dynamic` or `static`.
    pub data_sharding: String,
    /// The dealer's account (dynamic data sharding).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub dealer: Option<DataReport>,
    /// The CTR figures.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub ctr: Option<CtrSummary>,
    /// Replicated shards (`--replicas` ≥ 2): `failovers`, `serving`, `backups_in_sync`, `spare_processes`,
    /// `failover_s`.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub replication: Option<ReplicationReport>,
}

/// One mode switch in [`LocalSummary`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SwitchSummary {
    /// The decision's number.
    pub decision: u64,
    /// Mode before and after.
    pub from: String,
    pub to: String,
    /// First worker step run in the new mode.
    pub from_step: u64,
    /// Why the coordinator decided it.
    pub reason: String,
}

/// The CTR fields of [`LocalSummary`] (see [`CtrReport`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CtrSummary {
    /// `--sparse-rule`.
    pub sparse_rule: String,
    /// `--sparse-adagrad-init` in effect (0: none).
    pub sparse_adagrad_init: f32,
    /// `--data`.
    pub data: String,
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub auc: f64,
    pub teacher_auc: Option<f64>,
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub logloss: f64,
    /// Rounded to a whole sample.
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub samples_per_s: f64,
    pub bad_lines: u64,
    pub table_rows: u64,
    pub table_bytes: u64,
    /// Rounded to 3 decimals.
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub epochs: f64,
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub constant_logloss: f64,
    pub rows_dropped_stale: u64,
    /// Worker 0's held-out evaluations.
    pub heldout_curve: Vec<HeldoutPoint>,
    pub stopped_early: u32,
    /// The observer's evaluations.
    pub timeline: Vec<TimelinePoint>,
}

/// One of worker 0's held-out evaluations (`--eval-every`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeldoutPoint {
    pub step: u64,
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub epochs: f64,
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub logloss: f64,
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub auc: f64,
}

/// One of the observer's evaluations (`--eval-interval`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimelinePoint {
    /// Seconds since training started.
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub t_s: f64,
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub auc: f64,
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub logloss: f64,
}

impl LocalReport {
    /// The summary with the flags that shaped the run.
    pub fn summary(&self, args: &LocalArgs) -> LocalSummary {
        LocalSummary {
            servers: self.servers,
            workers: self.workers,
            model: args.model.name().into(),
            rule: args.rule().name().into(),
            counters: self.counters.clone(),
            mode: args.modes.mode.name().into(),
            wire_dtype: args.wire_dtype.name().into(),
            switches: self
                .switches
                .iter()
                .map(|s| SwitchSummary {
                    decision: s.number,
                    from: mode_name(s.from).into(),
                    to: mode_name(s.to).into(),
                    from_step: s.from_step,
                    reason: s.reason.clone(),
                })
                .collect(),
            data_sharding: if self.data.is_some() { "dynamic" } else { "static" }.into(),
            dealer: self.data.clone(),
            ctr: self.ctr.as_ref().map(|c| CtrSummary {
                sparse_rule: args.tables.sparse_rule.name().into(),
                sparse_adagrad_init: args.tables().sparse_adagrad_init.unwrap_or(0.0),
                data: args.data.clone(),
                auc: c.auc,
                teacher_auc: c.teacher_auc,
                logloss: c.logloss,
                samples_per_s: c.samples_per_s.round(),
                bad_lines: c.bad_lines,
                table_rows: c.table_rows,
                table_bytes: c.table_bytes,
                epochs: (c.epochs * 1000.0).round() / 1000.0,
                constant_logloss: c.constant_logloss,
                rows_dropped_stale: c.rows_dropped_stale,
                heldout_curve: c
                    .heldout_curve
                    .iter()
                    .map(|&(step, epochs, logloss, auc)| HeldoutPoint { step, epochs, logloss, auc })
                    .collect(),
                stopped_early: c.stopped_early,
                timeline: c.timeline.iter().map(|&(t_s, auc, logloss)| TimelinePoint { t_s, auc, logloss }).collect(),
            }),
            replication: self.replication.clone(),
        }
    }

    /// The JSON line: [`LocalSummary`].
    pub fn to_json(&self, args: &LocalArgs) -> String {
        crate::reports::line(&self.summary(args))
    }
}

/// Acknowledged pushes that no shard's state holds: for each worker and shard, what the worker saw
/// acknowledged beyond the shard's own count of that worker's pushes applied (a worker whose id is unknown
/// is held against nothing). Independent of the shards' totals, so a push applied twice cannot hide a lost one.
pub(super) fn pushes_lost(acknowledged: &[(Option<u32>, Vec<u64>)], stats: &[gaps_common::wire::Stats]) -> u64 {
    let mut lost = 0;
    for (worker, per_shard) in acknowledged {
        let Some(worker) = worker else { continue };
        for (shard, acked) in per_shard.iter().enumerate() {
            let Some(st) = stats.iter().find(|s| s.shard as usize == shard) else { continue };
            let applied = match st.applied_by_worker.binary_search_by_key(worker, |a| a.worker) {
                Ok(i) => st.applied_by_worker[i].applied,
                Err(_) => 0,
            };
            lost += acked.saturating_sub(applied);
        }
    }
    lost
}

/// The `--mode` name of a mode's wire code.
pub(super) fn mode_name(code: u8) -> &'static str {
    gaps_shard::modes::Mode::from_code(code).map_or("unknown", |m| m.name())
}

/// The log-loss of the best constant predictor on `labels` (their own click rate): what a model must beat
/// to have learned anything.
pub(super) fn constant_logloss(labels: &[u8]) -> f64 {
    let n = labels.len().max(1) as f64;
    let p = (labels.iter().map(|l| f64::from(*l)).sum::<f64>() / n).clamp(1e-7, 1.0 - 1e-7);
    -(p * p.ln() + (1.0 - p) * (1.0 - p).ln())
}
