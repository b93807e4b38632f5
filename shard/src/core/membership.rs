//! Membership: the coordinator's shard table and worker registry (shard 0), worker leases on every shard,
//! the cluster map, heartbeats and leaving.

use super::*;

/// Coordinator state (shard 0 only): shard addresses and worker leases.
#[derive(Debug, Default)]
pub(super) struct Coordinator {
    pub(super) shard_addrs: BTreeMap<u32, String>,
    /// Replicated shards: who serves each shard, under which replica epoch, with which backups in sync
    /// (a shard missing here is served by its own process at epoch 0, no backup in sync).
    pub(super) replica_sets: BTreeMap<u32, ReplicaSet>,
    /// Shard processes that came back after their shard was taken over: where they listen (they serve no
    /// shard, and keep copies of others).
    pub(super) spare: BTreeMap<u32, String>,
    pub(super) next_worker: u32,
    /// Every worker id ever handed out.
    pub(super) registered: u32,
}

/// Who serves a shard (replicated shards): the process, the replica epoch, the backups in sync.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(super) struct ReplicaSet {
    pub(super) process: u32,
    pub(super) epoch: u64,
    pub(super) in_sync: Vec<u32>,
}

impl Coordinator {
    /// Every shard known, with who serves it.
    pub(super) fn shard_list(&self) -> Vec<ShardAddr> {
        self.shard_addrs
            .iter()
            .map(|(i, a)| {
                let set = self.replica_set(*i);
                ShardAddr { index: *i, addr: a.clone(), process: set.process, epoch: set.epoch, backups: set.in_sync }
            })
            .collect()
    }

    /// The processes whose own shard is served by another (see [`ClusterMap::spare`]).
    pub(super) fn spare_addrs(&self) -> Vec<ShardAddr> {
        self.spare
            .iter()
            .map(|(p, a)| ShardAddr { index: *p, addr: a.clone(), process: *p, epoch: 0, backups: Vec::new() })
            .collect()
    }

    /// Shard process `process` started again (it joins, or serves shard 0 from restored tables): it holds no
    /// copy of any shard, and no set counts it in sync.
    pub(super) fn started_again(&mut self, process: u32) {
        for set in self.replica_sets.values_mut() {
            set.in_sync.retain(|p| *p != process);
        }
    }

    /// Shard `shard`'s replica set.
    pub(super) fn replica_set(&self, shard: u32) -> ReplicaSet {
        self.replica_sets.get(&shard).cloned().unwrap_or(ReplicaSet { process: shard, epoch: 0, in_sync: Vec::new() })
    }
}

/// How many worker ids a coordinator started again from a checkpoint leaves out ([`ShardCore::restarted`]):
/// more than can register between two checkpoints.
pub const RESTART_ID_GAP: u32 = 1 << 16;

impl ShardCore {
    /// The registration a non-coordinator shard sends to the coordinator.
    pub fn join_request(&self) -> Message {
        Message::RegisterShard(RegisterShard {
            protocol: PROTOCOL_VERSION,
            shard: self.cfg.shard,
            num_shards: self.cfg.num_shards,
            addr: self.cfg.advertise.clone(),
            layout_fingerprint: self.cfg.layout.fingerprint(),
        })
    }

    /// Adopts the coordinator's answer to [`ShardCore::join_request`].
    pub fn joined(&mut self, map: &ClusterMap) -> Result<(), ShardError> {
        if map.num_shards != self.cfg.num_shards
            || !map.layout.same_model(&self.cfg.layout)
            || map.rule != self.rule_info()
        {
            return Err(ShardError::Misconfigured(
                "the coordinator's cluster map disagrees with this shard's configuration".into(),
            ));
        }
        self.epoch = map.epoch;
        Ok(())
    }

    /// After the live set changed: move the learning-rate multiplier, re-judge stragglers, and finish a
    /// synchronous step that no longer waits for anyone (a dead worker never holds a step longer than its
    /// lease).
    pub(super) fn membership_changed(&mut self, events: &mut Vec<CoreEvent>) {
        let live = self.members.leases.len() as u32;
        // The step's K, the worker count and the ramp may have changed: reads ahead are computed again.
        self.step.ahead_values.clear();
        let ramped = self.lr.ramp.set_workers(live, self.step.global_step, self.cfg.modes.lr_ramp_steps);
        if ramped && matches!(self.mode.active, Mode::Sync | Mode::Gba) {
            events.push(CoreEvent::LrRamp { workers: live, target: self.lr.ramp.target() });
        }
        self.judge(events);
        if self.step_ready() {
            // Failures here are bugs of this shard; the next push reports them.
            let _ = self.complete_step();
        }
    }

    /// A push renews its worker's lease and reports its compute time (to the detector of the shard that
    /// decides modes).
    pub(super) fn observe_push(&mut self, worker: u32, compute_ms: u32, now: Duration, events: &mut Vec<CoreEvent>) {
        self.clock = self.clock.max(now);
        let joined = self.members.leases.insert(worker, now + self.cfg.lease).is_none();
        if compute_ms > 0 && self.decides_modes() {
            self.mode.detector.observe(worker, f64::from(compute_ms));
        }
        if joined {
            self.membership_changed(events);
        } else {
            self.judge(events);
        }
    }

    pub(super) fn coordinator(&mut self) -> Result<&mut Coordinator, ShardError> {
        let shard = self.cfg.shard;
        self.coordinator.as_mut().ok_or_else(|| {
            ShardError::Misconfigured(format!("shard {shard} is not the coordinator; register with shard 0"))
        })
    }

    pub(super) fn cluster_map(&self, worker_id: Option<u32>) -> Result<ClusterMap, ShardError> {
        let c = self.coordinator.as_ref().ok_or_else(|| ShardError::Misconfigured("not the coordinator".into()))?;
        let missing: Vec<String> =
            (0..self.cfg.num_shards).filter(|s| !c.shard_addrs.contains_key(s)).map(|s| s.to_string()).collect();
        if !missing.is_empty() {
            return Err(ShardError::ClusterIncomplete(format!(
                "cluster incomplete: shard(s) {} of {} have not registered with the coordinator",
                missing.join(", "),
                self.cfg.num_shards
            )));
        }
        self.known_map(worker_id)
    }

    /// The cluster map as the coordinator knows it so far (the shards registered until now).
    fn known_map(&self, worker_id: Option<u32>) -> Result<ClusterMap, ShardError> {
        let c = self.coordinator.as_ref().ok_or_else(|| ShardError::Misconfigured("not the coordinator".into()))?;
        Ok(ClusterMap {
            epoch: self.epoch,
            worker_id,
            num_shards: self.cfg.num_shards,
            shards: c.shard_list(),
            layout: self.cfg.layout.clone(),
            lease_ms: self.cfg.lease.as_millis().min(u128::from(u32::MAX)) as u32,
            rule: self.rule_info(),
            // Filled in by the service, which holds the credentials.
            token: None,
            auth_key: None,
            // Filled in by the service, which knows the setting.
            replicas: 1,
            spare: c.spare_addrs(),
        })
    }

    pub(super) fn rule_info(&self) -> RuleInfo {
        RuleInfo {
            name: self.cfg.rule.name().to_string(),
            momentum: self.cfg.hyper.momentum,
            weight_decay: self.cfg.hyper.weight_decay,
            sparse: self.cfg.sparse.rule.name().to_string(),
        }
    }

    /// A worker or an observer joins through the coordinator ([`coordinator_only`]).
    pub(super) fn register(
        &mut self,
        req: &Register,
        now: Duration,
        events: &mut Vec<CoreEvent>,
    ) -> Result<Frame, ShardError> {
        if req.protocol != PROTOCOL_VERSION {
            return Err(ShardError::Misconfigured(format!(
                "client speaks protocol {}, this cluster speaks {PROTOCOL_VERSION}",
                req.protocol
            )));
        }
        // Check completeness before handing out an id, so a refused registration changes nothing.
        self.cluster_map(None)?;
        let lease = self.cfg.lease;
        let worker_id = match req.role {
            Role::Observer => None,
            Role::Worker => {
                let c = self.coordinator()?;
                let id = c.next_worker;
                c.next_worker = id.checked_add(1).ok_or_else(|| {
                    ShardError::Misconfigured("this cluster handed out every worker id there is".into())
                })?;
                c.registered += 1;
                events.push(CoreEvent::WorkerJoined(id));
                Some(id)
            }
        };
        if let Some(id) = worker_id {
            self.members.leases.insert(id, now + lease);
            self.membership_changed(events);
        }
        Ok(Frame::new(Message::ClusterMap(self.cluster_map(worker_id)?)))
    }

    pub(super) fn register_shard(
        &mut self,
        req: &RegisterShard,
        events: &mut Vec<CoreEvent>,
    ) -> Result<Frame, ShardError> {
        let num_shards = self.cfg.num_shards;
        let fingerprint = self.cfg.layout.fingerprint();
        let c = self.coordinator()?;
        if req.protocol != PROTOCOL_VERSION {
            return Err(ShardError::Misconfigured(format!(
                "shard {} speaks protocol {}, the coordinator {PROTOCOL_VERSION}",
                req.shard, req.protocol
            )));
        }
        if req.num_shards != num_shards {
            return Err(ShardError::Misconfigured(format!(
                "shard {} was started with --num-shards {}, the coordinator with {num_shards}",
                req.shard, req.num_shards
            )));
        }
        // Process 0 joins only as a spare, once another process serves shard 0 (a majority chose so).
        if req.shard >= num_shards || (req.shard == 0 && c.replica_set(0).process == 0) {
            return Err(ShardError::Misconfigured(format!("shard index {} is not in 1..{num_shards}", req.shard)));
        }
        if req.layout_fingerprint != fingerprint {
            return Err(ShardError::Misconfigured(format!(
                "shard {} has a different model layout than the coordinator: start every shard with the same layout file",
                req.shard
            )));
        }
        // A process that joins has just started: it holds no copy of any shard, and no set counts it in sync.
        c.started_again(req.shard);
        let set = c.replica_set(req.shard);
        // A process whose shard was taken over while it was down comes back as a spare, which serves no shard
        // and keeps copies of others (it learns so from the map below). So does one whose shard has a backup
        // in sync, which holds what it acknowledged since its checkpoint: that backup takes the shard over (the
        // probe of the old address finds a spare, which answers `Moved`), or, should it turn out to hold
        // nothing (it started again too, and joins), the process has its shard granted back
        // ([`ShardCore::promote`]).
        let waits = set.process == req.shard && !set.in_sync.is_empty();
        if set.process != req.shard || waits {
            c.spare.insert(req.shard, req.addr.clone());
        } else {
            // Serving its own shard again: no longer a spare (an earlier life may have been one).
            c.spare.remove(&req.shard);
            c.shard_addrs.insert(req.shard, req.addr.clone());
        }
        events.push(CoreEvent::ShardJoined(req.shard));
        // The joining shard needs the epoch and layout even while other shards are still missing: the map of
        // the shards known so far (a process that came back learns here that its shard is served by another).
        Ok(Frame::new(Message::ClusterMap(self.known_map(None)?)))
    }

    /// To call on a shard started again from a checkpoint (a crash, not a rollback): the coordinator may have
    /// handed out worker ids after the checkpoint was written, which its state no longer knows. Those ids
    /// stay valid — a worker that holds one is admitted again by its next heartbeat, with its lease — and new
    /// registrations skip past them ([`RESTART_ID_GAP`] ids), so no id is handed out twice (two workers with
    /// one id would share one exactly-once window: one's pushes acknowledged as the other's duplicates).
    pub fn restarted(&mut self) {
        if let Some(c) = self.coordinator.as_mut() {
            c.next_worker = c.next_worker.saturating_add(RESTART_ID_GAP);
        }
    }

    /// Renews `worker`'s lease (a heartbeat, a split request); a worker without one joins the live set.
    /// The coordinator knows every id it handed out and refuses others; other shards learn workers this way.
    /// A worker that left is refused: its last heartbeat may arrive after its `Leave`.
    pub(super) fn renew_lease(
        &mut self,
        worker: u32,
        now: Duration,
        events: &mut Vec<CoreEvent>,
    ) -> Result<(), ShardError> {
        if let Some(c) = &self.coordinator {
            if worker >= c.next_worker {
                return Err(ShardError::NotRegistered(format!("worker {worker} never registered")));
            }
        }
        if self.members.left.contains(worker) {
            return Err(ShardError::NotRegistered(format!("worker {worker} left the job")));
        }
        if self.members.leases.insert(worker, now + self.cfg.lease).is_none() {
            self.membership_changed(events);
        }
        Ok(())
    }

    pub(super) fn heartbeat(
        &mut self,
        h: Heartbeat,
        now: Duration,
        events: &mut Vec<CoreEvent>,
    ) -> Result<Frame, ShardError> {
        self.renew_lease(h.worker, now, events)?;
        Ok(Frame::new(Message::HeartbeatAck(HeartbeatAck {
            epoch: self.epoch,
            live_workers: self.members.leases.len() as u32,
        })))
    }

    pub(super) fn leave(&mut self, l: Leave, events: &mut Vec<CoreEvent>) -> Result<Frame, ShardError> {
        self.members.left.insert(l.worker);
        if self.members.leases.remove(&l.worker).is_some() {
            self.forget_worker(l.worker, events);
            events.push(CoreEvent::WorkerLeft(l.worker));
            self.membership_changed(events);
        }
        Ok(Frame::new(Message::HeartbeatAck(HeartbeatAck {
            epoch: self.epoch,
            live_workers: self.members.leases.len() as u32,
        })))
    }

    /// A worker is gone from this shard (it left, or its lease expired): drop what was kept for it alone —
    /// its straggler record, its SSP clock and its per-worker optimizer planes. Under the DANA rules the
    /// shared sum S of momenta loses the worker's share: a departed worker takes no more steps, so the
    /// look-ahead stops counting it. (Its exactly-once window stays: a worker whose lease expired during a
    /// partition may still retry a push; the window is 512 bytes.)
    pub(super) fn forget_worker(&mut self, worker: u32, events: &mut Vec<CoreEvent>) {
        self.mode.detector.forget(worker);
        self.step.gba_hold.forget(worker);
        self.data_worker_gone(worker);
        self.members.clocks.remove(&worker);
        if self.resident.is_some() {
            if let Err(e) = self.release_resident_worker(worker) {
                events.push(CoreEvent::DeviceFault(format!(
                    "freeing the per-worker planes of departed worker {worker}: {e} (its stripe is retired; \
                     the shared sum of a look-ahead rule may still count its momentum)"
                )));
            }
            return;
        }
        for slot in &mut self.slots {
            let Some(planes) = slot.workers.remove(&worker) else { continue };
            if self.tensor_rules[slot.tensor as usize].0.layout().lookahead {
                let n = slot.params.len();
                slot.shared[..n].iter_mut().zip(&planes[..n]).for_each(|(s, v)| *s -= v);
            }
        }
    }
}

impl ShardCore {
    /// On the coordinator, who serves shard `shard`: its address, the process and the replica epoch.
    pub fn serving(&self, shard: u32) -> Option<(String, u32, u64)> {
        let c = self.coordinator.as_ref()?;
        let set = c.replica_set(shard);
        Some((c.shard_addrs.get(&shard)?.clone(), set.process, set.epoch))
    }

    /// On a coordinator restored from its checkpoint by shard process `process` (it started again): that
    /// process holds no copy of any shard now, and no replica set counts it in sync.
    pub fn serving_restored(&mut self, process: u32) {
        if let Some(c) = self.coordinator.as_mut() {
            c.started_again(process);
        }
    }

    /// On the coordinator, the shard processes that joined as spares (serving no shard of their own).
    pub fn spare_processes(&self) -> Vec<u32> {
        self.coordinator.as_ref().map_or_else(Vec::new, |c| c.spare.keys().copied().collect())
    }

    /// On the coordinator, where each shard process listens, process order: its own shard's address while
    /// it serves it, or its address as a spare (a process whose shard was taken over and that is not back
    /// is missing).
    pub fn process_addrs(&self) -> Vec<(u32, String)> {
        self.coordinator
            .as_ref()
            .map_or_else(Vec::new, |c| gaps_common::wire::process_addrs(&c.shard_list(), &c.spare_addrs()))
    }

    /// A primary's report of its backups in sync ([`ReplicaReport`]); refused as moved when the sender no
    /// longer serves the shard under that epoch.
    pub(super) fn replica_report(
        &mut self,
        r: &ReplicaReport,
        events: &mut Vec<CoreEvent>,
    ) -> Result<Frame, ShardError> {
        let num_shards = self.cfg.num_shards;
        let c = self.coordinator()?;
        if r.shard >= num_shards {
            return Err(ShardError::Misconfigured(format!("no shard {} in a cluster of {num_shards}", r.shard)));
        }
        let mut set = c.replica_set(r.shard);
        if (set.process, set.epoch) != (r.process, r.epoch) {
            return Err(ShardError::Moved(format!(
                "shard {} is served by shard process {} under replica epoch {}, not by {} under {}",
                r.shard, set.process, set.epoch, r.process, r.epoch
            )));
        }
        let mut in_sync: Vec<u32> = r.in_sync.iter().copied().filter(|p| *p < num_shards && *p != r.process).collect();
        in_sync.sort_unstable();
        in_sync.dedup();
        if in_sync.iter().any(|p| !set.in_sync.contains(p)) {
            events.push(CoreEvent::InSyncGrew { shard: r.shard, in_sync: in_sync.clone() });
        }
        set.in_sync = in_sync;
        c.replica_sets.insert(r.shard, set);
        Ok(Frame::new(Message::ReplicaEpoch(ReplicaEpoch { shard: r.shard, epoch: r.epoch })))
    }

    /// On a copy of the coordinator that shard process `process` takes over (a majority chose it to serve
    /// shard 0 at `addr`, docs/replication.md step 4): the coordinator's tables say so before its first
    /// request — shard 0 served by `process` under the next replica epoch, no backup in sync — so that the
    /// maps it hands out send clients there. Returns that epoch.
    pub fn serve_coordinator_copy(&mut self, process: u32, addr: &str) -> Result<u64, ShardError> {
        let c = self.coordinator()?;
        let epoch = c.replica_set(0).epoch + 1;
        c.replica_sets.insert(0, ReplicaSet { process, epoch, in_sync: Vec::new() });
        c.shard_addrs.insert(0, addr.to_string());
        Ok(epoch)
    }

    /// A backup taking over its shard ([`Promote`]): granted to a backup in sync under the shard's epoch,
    /// which then serves it under the next epoch at its address — or to the process serving it, started again,
    /// once no backup is in sync. (The service checked that the primary does not answer.)
    pub(super) fn promote(&mut self, p: &Promote, events: &mut Vec<CoreEvent>) -> Result<Frame, ShardError> {
        let num_shards = self.cfg.num_shards;
        let c = self.coordinator()?;
        if p.shard == 0 || p.shard >= num_shards {
            return Err(ShardError::Misconfigured(format!(
                "shard {} cannot be taken over (the coordinator's fail-over is not built yet)",
                p.shard
            )));
        }
        let set = c.replica_set(p.shard);
        if set.epoch != p.epoch {
            return Err(ShardError::Moved(format!(
                "shard {} is under replica epoch {}, not {}: it was taken over already",
                p.shard, set.epoch, p.epoch
            )));
        }
        if set.process == p.process {
            // The process serving the shard started again and serves it from its checkpoint at a new address:
            // only once no backup is in sync (one that is holds what was acknowledged since; it takes the
            // shard over instead). A process that joins holds no copy, and leaves every in-sync set.
            if !set.in_sync.is_empty() {
                return Err(ShardError::Misconfigured(format!(
                    "shard {}'s backups {:?} are in sync: one of them takes it over",
                    p.shard, set.in_sync
                )));
            }
        } else if !set.in_sync.contains(&p.process) {
            return Err(ShardError::Misconfigured(format!(
                "shard process {} is not a backup in sync of shard {} (in sync: {:?})",
                p.process, p.shard, set.in_sync
            )));
        }
        let epoch = set.epoch + 1;
        c.replica_sets.insert(p.shard, ReplicaSet { process: p.process, epoch, in_sync: Vec::new() });
        c.shard_addrs.insert(p.shard, p.addr.clone());
        events.push(CoreEvent::ShardPromoted { shard: p.shard, process: p.process, epoch });
        Ok(Frame::new(Message::ReplicaEpoch(ReplicaEpoch { shard: p.shard, epoch })))
    }
}
