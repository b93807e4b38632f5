//! Checkpoints of a shard: [`ShardCore::checkpoint`] writes everything needed to continue exactly, and
//! [`ShardCore::restore`] builds a shard from it. The byte format is [`crate::checkpoint`]'s.
//!
//! Kept: parameters, every optimizer plane (per-worker planes included), per-chunk and per-tensor versions,
//! the exactly-once windows and per-worker push ledgers, sparse tables (rows, state, versions, last touches, admission sketch), the
//! synchronous-step accumulators, global step, SSP clocks, learning-rate scale, ramp and η_max, the
//! coordinator's shard table and worker counter, the cluster epoch, the counters, and which workers held a
//! lease (each gets a fresh lease at restore). Not kept: the straggler detector's averages (re-learned
//! within a few steps).

use super::*;
use crate::checkpoint::{CheckpointError, Reader, Writer};

/// What a checkpoint says about itself, readable without restoring it: its header. From format 7 on it is
/// this struct as JSON (a length, then the text, right after the magic and the format version), so a
/// field is found by name and a header with a field this version does not know is refused; formats 2 to 6
/// hold the same fields at fixed places.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointInfo {
    /// The checkpoint's id (chosen by whoever asked for it).
    pub id: u64,
    /// The shard that wrote it.
    pub shard: u32,
    /// Shards in its cluster.
    pub num_shards: u32,
    /// Its cluster epoch.
    pub epoch: u64,
    /// Its layout fingerprint.
    pub layout_fingerprint: u64,
    /// Updates applied per tensor when it was taken.
    pub tensor_versions: Vec<u64>,
    /// Each tensor's and table's update rule, in layout order (a restore under other rules is refused).
    pub rules: String,
}

/// The counters of a checkpoint, kept as an encoded [`Stats`] frame. Older formats lack the trailing fields
/// added since: format 2 (protocol 9) `pushes_dropped_at_switch`, formats 2 and 3 (protocol 10)
/// `pushes_applied_twice` and `applied_by_worker`; a zero byte (a varint 0, an empty list) is appended to
/// their header for each to read them.
fn decode_stats(frame: &[u8], format: u32) -> Option<Stats> {
    let limits = gaps_common::wire::Limits::default();
    let missing: u32 = match format {
        0..=2 => 3,
        3 => 2,
        _ => 0,
    };
    let decoded = if missing == 0 {
        gaps_common::wire::decode_frame(frame, &limits).ok()
    } else {
        let len = u32::from_le_bytes(frame.get(1..5)?.try_into().ok()?).checked_add(missing)?;
        let mut patched = Vec::with_capacity(frame.len() + missing as usize);
        patched.push(*frame.first()?);
        patched.extend_from_slice(&len.to_le_bytes());
        patched.extend_from_slice(frame.get(5..)?);
        patched.extend(std::iter::repeat_n(0, missing as usize));
        gaps_common::wire::decode_frame(&patched, &limits).ok()
    };
    match decoded {
        Some(Frame { msg: Message::Stats(s), .. }) => Some(s),
        _ => None,
    }
}

fn mismatch(what: String) -> CheckpointError {
    CheckpointError::Mismatch(what)
}

/// The rules every tensor and table resolved to, as names (a restore with other rules is refused).
fn rule_names(core: &ShardCore) -> String {
    let dense = core.tensor_rules.iter().map(|(r, _)| r.name());
    let sparse = core.table_rules.iter().map(|(r, _)| r.name());
    dense.chain(std::iter::once("|")).chain(sparse).collect::<Vec<_>>().join(",")
}

/// The header: JSON from format 7 on, fixed places before.
fn read_info(r: &mut Reader<'_>) -> Result<CheckpointInfo, CheckpointError> {
    if r.format() >= 7 {
        let text = r.bytes("header")?;
        return serde_json::from_slice(&text).map_err(|e| CheckpointError::Corrupt(format!("the header: {e}")));
    }
    Ok(CheckpointInfo {
        id: r.u64()?,
        shard: r.u32()?,
        num_shards: r.u32()?,
        epoch: r.u64()?,
        layout_fingerprint: r.u64()?,
        tensor_versions: r.u64s("tensor versions")?,
        rules: r.str("rules")?,
    })
}

impl ShardCore {
    /// A checkpoint of this shard as bytes, labelled `id`. Fails only when the device holding the dense
    /// state cannot be read.
    pub fn checkpoint(&self, id: u64) -> Result<Vec<u8>, ShardError> {
        self.checkpoint_into(id, Vec::new())
    }

    /// [`ShardCore::checkpoint`] written into `buf` (cleared first; pass the previous checkpoint's buffer
    /// to keep the pause short). Resident state is copied back chunk by chunk as it is written.
    pub fn checkpoint_into(&self, id: u64, buf: Vec<u8>) -> Result<Vec<u8>, ShardError> {
        let mut w = Writer::reusing(buf, self.checkpoint_size_hint());
        let header = CheckpointInfo {
            id,
            shard: self.cfg.shard,
            num_shards: self.cfg.num_shards,
            epoch: self.epoch,
            layout_fingerprint: self.cfg.layout.fingerprint(),
            tensor_versions: self.tensor_versions.clone(),
            rules: rule_names(self),
        };
        let text = serde_json::to_vec(&header).map_err(|e| ShardError::Misconfigured(format!("a header: {e}")))?;
        w.bytes(&text);
        self.write_slots(&mut w)?;
        self.write_coordinator(&mut w);
        w.bytes(&gaps_common::wire::encode_frame(&Frame::new(Message::Stats(self.stats.clone()))).unwrap_or_default());
        w.u32(self.lr.scale.to_bits());
        w.f32s(&self.lr.max);
        w.f64(self.lr.last_multiplier);
        w.u8(self.mode.active.code());
        w.u32(self.step.accum_pushes);
        w.u32s(&self.step.contributors.iter().copied().collect::<Vec<_>>());
        w.u64(self.step.global_step);
        self.lr.ramp.write_to(&mut w);
        w.u64(self.members.clocks.len() as u64);
        for (worker, clock) in &self.members.clocks {
            w.u32(*worker);
            w.u64(*clock);
        }
        for table in &self.tables {
            table.write_to(&mut w);
        }
        w.u32s(&self.members.leases.keys().copied().collect::<Vec<_>>());
        for accum in &self.step.row_accum {
            let (ids, sums) = accum.parts();
            w.u64s(ids);
            w.f32s(sums);
        }
        self.write_modes(&mut w);
        // Format 3: per-grant sample counts, then the dealer (last: its settings come later, at
        // `set_dealer`).
        self.data.write_to(&mut w);
        // Format 4: the per-worker push ledgers.
        let mut ledger: Vec<_> = self.once.ledger.iter().collect();
        ledger.sort_by_key(|(id, _)| **id);
        w.u64(ledger.len() as u64);
        for (worker, l) in ledger {
            w.u32(*worker);
            l.write_to(&mut w);
        }
        match &self.dealer {
            Some(d) => {
                w.u8(1);
                d.write_to(&mut w);
            }
            None => w.u8(0),
        }
        Ok(w.buf)
    }

    /// Writes every chunk slot (resident state copied back as it goes), the step's counts and the
    /// exactly-once windows: what [`Self::read_slots`] reads.
    fn write_slots(&self, w: &mut Writer) -> Result<(), ShardError> {
        let (mut params, mut shared, mut plane) = (Vec::new(), Vec::new(), Vec::new());
        let resident = self.resident.is_some();
        for (i, slot) in self.slots.iter().enumerate() {
            w.u64(slot.version);
            if resident {
                self.resident_planes(i, &mut params, &mut shared)?;
            }
            w.f32s(if resident { &params[..] } else { &slot.params[..] });
            w.f32s(if resident { &shared } else { &slot.shared });
            let mut workers: Vec<_> = slot.workers.iter().collect();
            workers.sort_by_key(|(id, _)| **id);
            w.u64(workers.len() as u64);
            for (worker, planes) in workers {
                w.u32(*worker);
                if resident {
                    plane.clear();
                    self.resident_worker_plane(i, *worker, &mut plane)?;
                    w.f32s(&plane);
                } else {
                    w.f32s(planes);
                }
            }
            w.f32s(&self.step.accum[i]);
        }
        w.u32s(&self.step.accum_counts);
        let mut seqs: Vec<_> = self.once.seqs.iter().collect();
        seqs.sort_by_key(|(id, _)| **id);
        w.u64(seqs.len() as u64);
        for (worker, window) in seqs {
            w.u32(*worker);
            window.write_to(w);
        }
        Ok(())
    }

    /// Writes the coordinator's books, or that this shard is not the coordinator: what
    /// [`Self::read_coordinator`] reads.
    fn write_coordinator(&self, w: &mut Writer) {
        match &self.coordinator {
            Some(c) => {
                w.u8(1);
                w.u64(c.shard_addrs.len() as u64);
                for (index, addr) in &c.shard_addrs {
                    w.u32(*index);
                    w.str(addr);
                }
                w.u32(c.next_worker);
                w.u32(c.registered);
                w.u64(c.replica_sets.len() as u64);
                for (shard, set) in &c.replica_sets {
                    w.u32(*shard);
                    w.u32(set.process);
                    w.u64(set.epoch);
                    w.u32s(&set.in_sync);
                }
                w.u64(c.spare.len() as u64);
                for (process, addr) in &c.spare {
                    w.u32(*process);
                    w.str(addr);
                }
            }
            None => w.u8(0),
        }
    }

    /// Writes what [`Self::read_modes`] reads.
    fn write_modes(&self, w: &mut Writer) {
        for d in [self.mode.decisions.latest, self.mode.decisions.previous] {
            w.u64s(&[d.number, u64::from(d.mode), d.from_step]);
        }
        w.u64(self.mode.max_step);
        w.u64(self.mode.decision_reasons.len() as u64);
        for (number, why) in &self.mode.decision_reasons {
            w.u64(*number);
            w.str(why);
        }
        w.u64(self.mode.switches.len() as u64);
        for sw in &self.mode.switches {
            w.u64s(&[sw.number, u64::from(sw.from), u64::from(sw.to), sw.from_step, sw.at_global_step]);
            w.str(&sw.reason);
        }
    }

    /// About how many bytes [`ShardCore::checkpoint`] writes: the float planes and tables (the rest is small).
    fn checkpoint_size_hint(&self) -> usize {
        let slots: usize = self
            .slots
            .iter()
            .zip(&self.step.accum)
            .map(|(s, a)| {
                let l = self.tensor_rules[s.tensor as usize].0.layout();
                s.len * (1 + l.shared_planes + l.worker_planes * s.workers.len()) + a.len()
            })
            .sum();
        let tables: usize = self.tables.iter().map(|t| t.checkpoint_size_hint()).sum();
        slots * 4 + tables + 64 * self.slots.len() + 600 * self.once.seqs.len() + 4096
    }

    /// This shard returned to its checkpoint `bytes` (a cluster rollback, every shard to the same checkpoint).
    /// The training state — parameters, optimizer planes, versions, the step, exactly-once windows, tables,
    /// counters, mode decisions — comes from the checkpoint; who is in the cluster stays as it is now (the
    /// live workers and their leases, the shards' addresses, the worker ids handed out, the straggler
    /// record), since those did not go back in time. A worker that held planes in the checkpoint but has
    /// left since is forgotten as if it left now. GPU-resident state is not carried over: the caller makes
    /// the returned core resident again.
    pub fn rolled_back(&mut self, bytes: &[u8]) -> Result<ShardCore, CheckpointError> {
        let mut core = ShardCore::restore(self.cfg.clone(), bytes)?;
        if core.epoch != self.epoch {
            return Err(mismatch(format!(
                "it was taken in cluster epoch {}, this shard is in {}",
                core.epoch, self.epoch
            )));
        }
        let mut events = Vec::new();
        let gone: Vec<u32> =
            core.members.leases.keys().filter(|w| !self.members.leases.contains_key(w)).copied().collect();
        for w in gone {
            core.members.leases.remove(&w);
            core.forget_worker(w, &mut events);
        }
        core.members.leases = self.members.leases.clone();
        core.members.left = std::mem::take(&mut self.members.left);
        if let (Some(now), Some(then)) = (self.coordinator.as_ref(), core.coordinator.as_mut()) {
            then.shard_addrs = now.shard_addrs.clone();
            // Who serves each shard stays as it is now; no backup is in sync with a primary that went back
            // until that primary reports it again (after copying it the state it went back to).
            then.replica_sets = now.replica_sets.clone();
            then.spare = now.spare.clone();
            for set in then.replica_sets.values_mut() {
                set.in_sync.clear();
            }
            then.next_worker = then.next_worker.max(now.next_worker);
            then.registered = then.registered.max(now.registered);
        }
        core.mode.detector = std::mem::take(&mut self.mode.detector);
        core.mode.decided_at = self.mode.decided_at;
        core.clock = self.clock;
        core.now_s = self.now_s;
        core.replies.shared_replies = self.replies.shared_replies;
        core.replies.packed_replies = self.replies.packed_replies;
        core.step.step_started = (!core.step.contributors.is_empty()).then_some(self.clock);
        // The dealer goes back with the model: splits finished since the checkpoint are dealt again (their
        // training is gone), and those on loan then are given back (their holders drop them).
        if let Some(d) = &self.dealer {
            core.set_dealer(d.config().clone()).map_err(CheckpointError::Mismatch)?;
            if let Some(back) = core.dealer.as_mut() {
                back.continue_after(d);
            }
        }
        core.membership_changed(&mut events);
        Ok(core)
    }

    /// This shard's whole state for a backup's copy (replicated shards): a checkpoint, then what a
    /// checkpoint leaves to the restart — the clock, the leases' deadlines, when the step in progress
    /// started, when the coordinator last decided a mode, the straggler detector, the tables' eviction
    /// samplers, GBA's hold, the workers that left — and the checkpoint's length last, so that [`ShardCore::from_copy`] continues
    /// exactly where this core is: fed the same requests and ticks afterwards, it answers as this core does.
    pub fn copy_state(&self) -> Result<Vec<u8>, ShardError> {
        let mut out = self.checkpoint_into(0, Vec::new())?;
        let checkpoint_len = out.len() as u64;
        let mut w = Writer::reusing(Vec::new(), 1024);
        let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        w.u64(nanos(self.clock));
        w.u32(self.now_s);
        for t in [self.step.step_started, self.mode.decided_at] {
            match t {
                Some(t) => {
                    w.u8(1);
                    w.u64(nanos(t));
                }
                None => w.u8(0),
            }
        }
        w.u64(self.members.leases.len() as u64);
        for (worker, until) in &self.members.leases {
            w.u32(*worker);
            w.u64(nanos(*until));
        }
        self.mode.detector.write_to(&mut w);
        for table in &self.tables {
            w.u64s(&table.sampler_state());
        }
        self.step.gba_hold.write_to(&mut w);
        w.u32s_of(self.members.left.in_order());
        // The checkpoint, the rest, then the checkpoint's length (appended: the checkpoint is not copied again).
        out.extend_from_slice(&w.buf);
        out.extend_from_slice(&checkpoint_len.to_le_bytes());
        Ok(out)
    }

    /// A shard configured by `cfg` continuing the state [`ShardCore::copy_state`] wrote (its dealer, if any,
    /// waits for [`ShardCore::set_dealer_as_copy`]).
    pub fn from_copy(cfg: ShardConfig, bytes: &[u8]) -> Result<ShardCore, CheckpointError> {
        let corrupt = |what: &str| CheckpointError::Corrupt(format!("copy: {what}"));
        let trailer = bytes.len().checked_sub(8).ok_or_else(|| corrupt("length"))?;
        let (body, len) = bytes.split_at(trailer);
        let len = usize::try_from(u64::from_le_bytes(len.try_into().map_err(|_| corrupt("length"))?))
            .map_err(|_| corrupt("length"))?;
        let (checkpoint, rest) = body.split_at_checked(len).ok_or_else(|| corrupt("length"))?;
        let mut core = ShardCore::restore(cfg, checkpoint)?;
        let mut r = Reader::new(rest)?;
        let time = |r: &mut Reader<'_>| r.u64().map(Duration::from_nanos);
        core.clock = time(&mut r)?;
        core.now_s = r.u32()?;
        let optional = |r: &mut Reader<'_>| -> Result<Option<Duration>, CheckpointError> {
            Ok(match r.u8()? {
                0 => None,
                1 => Some(time(r)?),
                _ => return Err(corrupt("a time")),
            })
        };
        core.step.step_started = optional(&mut r)?;
        core.mode.decided_at = optional(&mut r)?;
        let leases = r.u64()?;
        if leases != core.members.leases.len() as u64 {
            return Err(corrupt("lease holders"));
        }
        for _ in 0..leases {
            let worker = r.u32()?;
            let until = time(&mut r)?;
            match core.members.leases.get_mut(&worker) {
                Some(t) => *t = until,
                None => return Err(corrupt("lease holders")),
            }
        }
        core.mode.detector = crate::modes::StragglerDetector::read_from(&mut r)?;
        for table in &mut core.tables {
            let s: [u64; 4] = r.u64s("sampler")?.try_into().map_err(|_| corrupt("sampler"))?;
            table.set_sampler_state(s);
        }
        core.step.gba_hold = super::hold::GbaHold::read_from(&mut r)?;
        // The workers that left (absent from a copy made before shards kept them).
        if !r.at_end() {
            r.u32s("departed workers")?.into_iter().for_each(|w| core.members.left.insert(w));
        }
        r.finish()?;
        Ok(core)
    }

    /// Reads every chunk slot (version, parameters, shared and per-worker planes, step sums), the step's
    /// counts and the exactly-once windows.
    fn read_slots(&mut self, r: &mut Reader<'_>) -> Result<(), CheckpointError> {
        for i in 0..self.slots.len() {
            let what = format!("chunk slot {i}");
            let slot = &mut self.slots[i];
            slot.version = r.u64()?;
            slot.params = Arc::new(r.f32s_of(slot.params.len(), &what)?);
            slot.shared = r.f32s_of(slot.shared.len(), &what)?;
            let planes = self.tensor_rules[slot.tensor as usize].0.layout().worker_planes * slot.params.len();
            let workers = r.u64()?;
            slot.workers.clear();
            for _ in 0..workers {
                let worker = r.u32()?;
                slot.workers.insert(worker, r.f32s_of(planes, &what)?);
            }
            let accum = r.f32s(&what)?;
            if !accum.is_empty() && accum.len() != slot.len {
                return Err(mismatch(format!("{what}: accumulator of {} elements", accum.len())));
            }
            self.step.accum[i] = accum;
        }
        self.step.accum_counts = r.u32s("step counts")?;
        if self.step.accum_counts.len() != self.slots.len() {
            return Err(mismatch("step counts do not match the slots".into()));
        }
        let windows = r.u64()?;
        for _ in 0..windows {
            let worker = r.u32()?;
            self.once.seqs.insert(worker, SeqWindow::read_from(r)?);
        }
        Ok(())
    }

    /// Reads the coordinator's books (shard addresses, worker ids, replica sets, spares), present exactly
    /// when this shard is the coordinator.
    fn read_coordinator(&mut self, r: &mut Reader<'_>) -> Result<(), CheckpointError> {
        let is_coordinator = r.u8()? == 1;
        if is_coordinator != self.coordinator.is_some() {
            return Err(mismatch("coordinator role differs".into()));
        }
        if let Some(c) = self.coordinator.as_mut() {
            c.shard_addrs.clear();
            for _ in 0..r.u64()? {
                let index = r.u32()?;
                c.shard_addrs.insert(index, r.str("shard address")?);
            }
            // This shard's own address may have changed with the restart.
            c.shard_addrs.insert(0, self.cfg.advertise.clone());
            c.next_worker = r.u32()?;
            c.registered = r.u32()?;
            c.replica_sets.clear();
            if r.format() >= 6 {
                for _ in 0..r.u64()? {
                    let shard = r.u32()?;
                    let (process, epoch) = (r.u32()?, r.u64()?);
                    let in_sync = r.u32s("replica set")?;
                    c.replica_sets.insert(shard, super::membership::ReplicaSet { process, epoch, in_sync });
                }
                c.spare.clear();
                for _ in 0..r.u64()? {
                    let process = r.u32()?;
                    c.spare.insert(process, r.str("spare process")?);
                }
            }
        }
        Ok(())
    }

    /// Reads the mode decisions, the highest step heard of, the decisions' reasons and the switch log.
    fn read_modes(&mut self, r: &mut Reader<'_>) -> Result<(), CheckpointError> {
        let mut read_decision = || -> Result<ModeDecision, CheckpointError> {
            let corrupt = || CheckpointError::Corrupt("mode decision".into());
            let fields = r.u64s("mode decision")?;
            let [number, mode, from_step] = fields[..] else { return Err(corrupt()) };
            Ok(ModeDecision { number, mode: u8::try_from(mode).map_err(|_| corrupt())?, from_step })
        };
        let latest = read_decision()?;
        let previous = read_decision()?;
        self.mode.decisions = ModeDecisions { latest, previous };
        self.mode.max_step = r.u64()?;
        let reasons = r.u64()?;
        if reasons > 2 {
            return Err(CheckpointError::Corrupt("mode decision reasons".into()));
        }
        for _ in 0..reasons {
            let number = r.u64()?;
            self.mode.decision_reasons.push_back((number, r.str("mode decision reason")?));
        }
        let corrupt = || CheckpointError::Corrupt("mode switches".into());
        for _ in 0..r.u64()?.min(super::steps::SWITCH_LOG as u64 + 1) {
            let fields = r.u64s("mode switch")?;
            let [number, from, to, from_step, at_global_step] = fields[..] else { return Err(corrupt()) };
            let (from, to) = (u8::try_from(from).map_err(|_| corrupt())?, u8::try_from(to).map_err(|_| corrupt())?);
            let reason = r.str("mode switch")?;
            self.mode.switches.push_back(ModeSwitchRecord { number, from, to, from_step, at_global_step, reason });
        }
        if self.mode.switches.len() > super::steps::SWITCH_LOG {
            return Err(corrupt());
        }
        Ok(())
    }

    /// Reads the header of a checkpoint without restoring it.
    pub fn checkpoint_info(bytes: &[u8]) -> Result<CheckpointInfo, CheckpointError> {
        read_info(&mut Reader::new(bytes)?)
    }

    /// A shard configured by `cfg` with the state of checkpoint `bytes`. The checkpoint must come from the
    /// same shard index, shard count, layout and rules; anything else is refused with the reason.
    pub fn restore(cfg: ShardConfig, bytes: &[u8]) -> Result<ShardCore, CheckpointError> {
        // Every parameter is overwritten below: build the shard with zeros (no initializer to run), then
        // keep the configuration as given.
        let zeros = ShardConfig { init: Init { std: 0.0, ..cfg.init }, ..cfg.clone() };
        let mut core = ShardCore::new(zeros).map_err(|e| mismatch(format!("configuring the shard: {e}")))?;
        core.cfg = cfg;
        let mut r = Reader::new(bytes)?;
        let info = read_info(&mut r)?;
        let (shard, num_shards) = (core.cfg.shard, core.cfg.num_shards);
        if info.shard != shard || info.num_shards != num_shards {
            return Err(mismatch(format!(
                "it is shard {} of {}, this is shard {shard} of {num_shards}",
                info.shard, info.num_shards
            )));
        }
        if info.layout_fingerprint != core.cfg.layout.fingerprint() {
            return Err(mismatch("it was taken with another layout file".into()));
        }
        if info.tensor_versions.len() != core.tensor_versions.len() {
            return Err(mismatch("tensor count differs".into()));
        }
        if info.rules != rule_names(&core) {
            let runs = rule_names(&core);
            return Err(mismatch(format!("it was taken with rules {}, this shard runs {runs}", info.rules)));
        }
        core.epoch = info.epoch;
        core.tensor_versions = info.tensor_versions;
        core.read_slots(&mut r)?;
        core.read_coordinator(&mut r)?;
        let stats = r.bytes("counters")?;
        core.stats = match decode_stats(&stats, r.format()) {
            Some(s) => s,
            None => return Err(CheckpointError::Corrupt("counters".into())),
        };
        core.lr.scale = f32::from_bits(r.u32()?);
        core.lr.max = r.f32s_of(core.tensor_rules.len(), "η_max")?;
        core.lr.last_multiplier = r.f64()?;
        core.mode.active = Mode::from_code(r.u8()?).ok_or_else(|| CheckpointError::Corrupt("mode".into()))?;
        core.step.accum_pushes = r.u32()?;
        core.step.contributors = r.u32s("contributors")?.into_iter().collect();
        // A step saved in progress waits at most a lease from the restored core's start for the rest.
        core.step.step_started = (!core.step.contributors.is_empty()).then_some(Duration::ZERO);
        core.step.global_step = r.u64()?;
        core.lr.ramp = crate::modes::LrRamp::read_from(&mut r)?;
        core.members.clocks.clear();
        for _ in 0..r.u64()? {
            let worker = r.u32()?;
            core.members.clocks.insert(worker, r.u64()?);
        }
        for table in &mut core.tables {
            table.read_from(&mut r)?;
        }
        // The workers that held a lease get a fresh one from the restart (time 0 of the restored shard's
        // clock): a synchronous step in flight still waits for them, and a worker that is gone expires as
        // it would have.
        for worker in r.u32s("lease holders")? {
            core.members.leases.insert(worker, core.cfg.lease);
        }
        for (t, accum) in core.step.row_accum.iter_mut().enumerate() {
            let ids = r.u64s("row sums")?;
            let sums = r.f32s("row sums")?;
            accum.restore(ids, sums).map_err(|e| CheckpointError::Corrupt(format!("row sums of table {t}: {e}")))?;
        }
        core.read_modes(&mut r)?;
        if r.format() >= 3 {
            core.data = super::data::GrantCounts::read_from(&mut r)?;
            if r.format() >= 4 {
                let workers = r.u64()?;
                // More than the live-worker cap can be written when that many hold leases; refuse only
                // what no cluster could have (each ledger is also checked as it is read).
                if workers > 1 << 24 {
                    return Err(CheckpointError::Corrupt(format!("{workers} push ledgers")));
                }
                for _ in 0..workers {
                    let worker = r.u32()?;
                    core.once.ledger.insert(worker, AppliedSeqs::read_from(&mut r)?);
                }
            }
            if r.u8()? == 1 {
                core.restored_dealer = Some((r.format(), r.rest().to_vec()));
            }
        }
        r.finish()?;
        if !core.lr.scale.is_finite() || core.lr.scale <= 0.0 {
            return Err(CheckpointError::Corrupt("learning-rate scale".into()));
        }
        Ok(core)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_of_older_checkpoints_read_with_the_new_counters_zero() {
        let stats = Stats { shard: 3, pushes_applied: 41, dropped_stale: 7, ..Stats::default() };
        let frame = gaps_common::wire::encode_frame(&Frame::new(Message::Stats(stats.clone()))).expect("encode");
        assert_eq!(decode_stats(&frame, 4), Some(stats.clone()));
        // Older encodings: the same without the trailing zero bytes of the fields added since (protocol 10:
        // two fewer, protocol 9: three fewer).
        let older = |missing: usize| {
            let mut old = frame[..frame.len() - missing].to_vec();
            let len = u32::from_le_bytes(old[1..5].try_into().expect("len")) - missing as u32;
            old[1..5].copy_from_slice(&len.to_le_bytes());
            old
        };
        assert_eq!(decode_stats(&older(2), 3), Some(stats.clone()));
        assert_eq!(decode_stats(&older(3), 2), Some(stats));
        assert_eq!(decode_stats(&older(2), 4), None, "format 4 is not patched");
        assert_eq!(decode_stats(&[12, 1], 2), None, "a short frame is refused, not a panic");
    }
}
