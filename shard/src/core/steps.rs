//! Synchronous steps: sync (BSP) and GBA accumulation and completion, SSP clocks, and `auto`'s switching
//! between sync and gba on the straggler detector's verdict.

use super::*;

/// How many mode switches a shard remembers (reported in stats).
pub(super) const SWITCH_LOG: usize = 64;

/// The synchronous step in progress (sync and gba): what it holds, who sent it, since when, and how many
/// steps were applied before it. One part of [`ShardCore`]'s state, owned and reset as a whole.
#[derive(Debug)]
pub(super) struct StepState {
    /// Summed gradients per slot (allocated on first use) and how many were summed.
    pub(super) accum: Vec<Vec<f32>>,
    pub(super) accum_counts: Vec<u32>,
    /// gba: per slot with gradients in the step in progress, its values as if the step were applied with
    /// them alone (what a pull reads), computed on first use.
    pub(super) ahead_values: HashMap<usize, Arc<Vec<f32>>>,
    /// Gradients in the current step, and which workers sent them.
    pub(super) accum_pushes: u32,
    pub(super) contributors: BTreeSet<u32>,
    /// When the first gradient of the step arrived. A step does not wait longer than a lease for the
    /// workers that have not sent theirs: one that heartbeats but never pushes is a straggler, not a member
    /// whose gradient the step must have.
    pub(super) step_started: Option<Duration>,
    /// gba: which push-pulls wait for the step in progress ([`hold`]).
    pub(super) gba_hold: hold::GbaHold,
    /// Aggregated updates applied (sync and gba steps).
    pub(super) global_step: u64,
    /// Embedding-row gradients of the current step, summed per id, one per table.
    pub(super) row_accum: Vec<RowAccum>,
}

impl StepState {
    /// No step begun, none applied, for `slots` chunk slots and the tables' row sums.
    pub(super) fn new(slots: usize, row_accum: Vec<RowAccum>) -> Self {
        StepState {
            accum: vec![Vec::new(); slots],
            accum_counts: vec![0; slots],
            ahead_values: HashMap::new(),
            accum_pushes: 0,
            contributors: BTreeSet::new(),
            step_started: None,
            gba_hold: hold::GbaHold::default(),
            global_step: 0,
            row_accum,
        }
    }
}

/// The mode in force and how it came to be: the decisions known (under `auto` the coordinator's, carried
/// to the other shards by workers), the switches carried out, and the coordinator's straggler detector.
/// One part of [`ShardCore`]'s state.
#[derive(Debug)]
pub(super) struct ModeState {
    /// The mode in force (never `Auto`: auto runs `Sync` or `Gba`).
    pub(super) active: Mode,
    /// The newest two mode decisions known: under `auto`, the coordinator's own or ones a worker carried
    /// here; otherwise the configured mode (number 0).
    pub(super) decisions: ModeDecisions,
    /// Why the coordinator made its last two decisions, by number (none where learned from a worker).
    pub(super) decision_reasons: VecDeque<(u64, String)>,
    /// The largest worker step seen in a push (the coordinator places new decisions after it).
    pub(super) max_step: u64,
    /// Mode switches carried out, oldest first (the last [`SWITCH_LOG`]).
    pub(super) switches: VecDeque<ModeSwitchRecord>,
    pub(super) detector: StragglerDetector,
    /// When the coordinator made its last mode decision (auto; not kept in checkpoints).
    pub(super) decided_at: Option<Duration>,
}

impl ModeState {
    /// Running `active` (sync for `auto`), no decision made, nothing switched.
    pub(super) fn new(active: Mode) -> Self {
        ModeState {
            active,
            decisions: ModeDecisions::start(active.code()),
            decision_reasons: VecDeque::new(),
            max_step: 0,
            switches: VecDeque::new(),
            detector: StragglerDetector::default(),
            decided_at: None,
        }
    }
}

/// Embedding-row gradients of one table summed per id over a synchronous step.
#[derive(Debug, Clone)]
pub(crate) struct RowAccum {
    dim: usize,
    index: HashMap<u64, usize>,
    ids: Vec<u64>,
    sums: Vec<f32>,
}

impl RowAccum {
    pub(super) fn new(dim: usize) -> Self {
        RowAccum { dim, index: HashMap::new(), ids: Vec::new(), sums: Vec::new() }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Adds one row's gradient.
    pub(super) fn add(&mut self, id: u64, grad: &[f32]) {
        let dim = self.dim;
        let k = *self.index.entry(id).or_insert_with(|| {
            self.ids.push(id);
            self.sums.resize(self.sums.len() + dim, 0.0);
            self.ids.len() - 1
        });
        self.sums[k * dim..(k + 1) * dim].iter_mut().zip(grad).for_each(|(s, g)| *s += g);
    }

    /// The summed gradient of row `id`, if the step holds one.
    pub(super) fn get(&self, id: u64) -> Option<&[f32]> {
        self.index.get(&id).map(|&k| &self.sums[k * self.dim..(k + 1) * self.dim])
    }

    /// The ids (in the order first seen) and their summed gradients; empties the accumulator.
    pub(super) fn take(&mut self) -> (Vec<u64>, Vec<f32>) {
        self.index.clear();
        (std::mem::take(&mut self.ids), std::mem::take(&mut self.sums))
    }

    /// The ids and sums as they are (checkpoints).
    pub(super) fn parts(&self) -> (&[u64], &[f32]) {
        (&self.ids, &self.sums)
    }

    /// Restores ids and sums written by [`RowAccum::parts`].
    pub(super) fn restore(&mut self, ids: Vec<u64>, sums: Vec<f32>) -> Result<(), String> {
        if sums.len() != ids.len() * self.dim {
            return Err(format!("{} ids with {} summed values of dim {}", ids.len(), sums.len(), self.dim));
        }
        self.index = ids.iter().enumerate().map(|(k, id)| (*id, k)).collect();
        if self.index.len() != ids.len() {
            return Err("an id appears twice".into());
        }
        self.ids = ids;
        self.sums = sums;
        Ok(())
    }
}

impl ShardCore {
    /// Lets the detector judge the live workers. Under `auto` the coordinator alone turns its verdict into
    /// a numbered cluster-wide decision, effective two worker steps after the latest it has seen: every
    /// worker's next push to it is acknowledged with the decision, and the worker hands it to every other
    /// shard with its pushes before any of them reaches that step (see [`ShardCore::follow_decisions`]).
    /// It decides again only once its latest decision is in force, so the newest two decisions always
    /// name the mode of every step a worker may still push.
    pub(super) fn judge(&mut self, events: &mut Vec<CoreEvent>) {
        if !self.decides_modes() {
            return;
        }
        let live: BTreeSet<u32> = self.members.leases.keys().copied().collect();
        let reasons = self.mode.detector.judge(&live, &self.cfg.modes);
        let latest = self.mode.decisions.latest;
        let wanted = if self.mode.detector.stragglers().is_empty() { Mode::Sync } else { Mode::Gba };
        // A mode is kept at least `min_mode_time` (the first decision, out of the initial sync, at once).
        let settled = self.mode.decided_at.is_none_or(|at| self.clock >= at + self.cfg.modes.min_mode_time);
        if wanted.code() != latest.mode && self.mode.max_step >= latest.from_step && settled {
            self.mode.decided_at = Some(self.clock);
            // The reasons of this judgment, or of the change a minimum time in the mode held back.
            let reason = match (reasons.is_empty(), self.mode.detector.last_change().is_empty()) {
                (false, _) => reasons.join("; "),
                (true, false) => self.mode.detector.last_change().join("; "),
                (true, true) => "membership changed".to_string(),
            };
            let decision = ModeDecision {
                number: latest.number.saturating_add(1),
                mode: wanted.code(),
                from_step: self.mode.max_step.saturating_add(2),
            };
            self.mode.decisions.push(decision);
            events.push(CoreEvent::ModeDecided {
                number: decision.number,
                to: wanted,
                from_step: decision.from_step,
                reason: reason.clone(),
            });
            if self.mode.decision_reasons.len() == 2 {
                self.mode.decision_reasons.pop_front();
            }
            self.mode.decision_reasons.push_back((decision.number, reason));
        }
    }

    /// A push of worker step `step` carrying the worker's newest two decisions: keeps the newest two known
    /// here (a shard that restarted or joined learns the current ones this way, the coordinator too) and
    /// runs the step in the mode of the decision in force at it, so that every shard switches at the same
    /// worker step. A push of an older step than one already switched at runs in the mode in force.
    pub(super) fn follow_decisions(&mut self, step: u64, carried: &ModeDecisions, events: &mut Vec<CoreEvent>) {
        if self.cfg.modes.mode != Mode::Auto {
            return;
        }
        self.mode.max_step = self.mode.max_step.max(step);
        let valid = |d: &ModeDecision| matches!(Mode::from_code(d.mode), Some(Mode::Sync | Mode::Gba));
        if valid(&carried.latest) && carried.latest.number > self.mode.decisions.latest.number {
            let previous = if valid(&carried.previous) { carried.previous } else { carried.latest };
            self.mode.decisions.merge(&ModeDecisions { latest: carried.latest, previous });
        }
        let Some(decision) = self.mode.decisions.in_force(step) else { return };
        let Some(wanted) = Mode::from_code(decision.mode) else { return };
        let newer = self.mode.switches.back().is_none_or(|s| decision.number > s.number);
        if wanted == self.mode.active || !newer {
            return;
        }
        if self.mode.active == Mode::Gba && self.step_in_progress() {
            // The partial GBA step is applied as it is; sync starts on a fresh step.
            let _ = self.complete_step();
        }
        let reason = match self.mode.decision_reasons.iter().find(|(n, _)| *n == decision.number) {
            Some((_, why)) => why.clone(),
            None => format!("decision {} of the coordinator", decision.number),
        };
        if self.mode.switches.len() == SWITCH_LOG {
            self.mode.switches.pop_front();
        }
        self.mode.switches.push_back(ModeSwitchRecord {
            number: decision.number,
            from: self.mode.active.code(),
            to: wanted.code(),
            from_step: decision.from_step,
            at_global_step: self.step.global_step,
            reason: reason.clone(),
        });
        events.push(CoreEvent::ModeSwitch { from: self.mode.active, to: wanted, reason });
        self.mode.active = wanted;
        self.stats.mode_switches += 1;
    }

    /// True on the one shard that judges stragglers and decides modes: the coordinator under `auto`.
    pub(super) fn decides_modes(&self) -> bool {
        self.cfg.modes.mode == Mode::Auto && self.coordinator.is_some()
    }

    pub(super) fn min_clock(&self) -> u64 {
        self.members.leases.keys().map(|w| self.members.clocks.get(w).copied().unwrap_or(0)).min().unwrap_or(0)
    }

    /// A synchronous step is complete when every live worker contributed (sync) or K = live workers
    /// gradients arrived (gba).
    pub(super) fn step_ready(&self) -> bool {
        if self.step.accum_pushes == 0 {
            return false;
        }
        match self.mode.active {
            Mode::Sync => {
                self.members.leases.keys().all(|w| self.step.contributors.contains(w))
                    || self.step.step_started.is_some_and(|t| self.clock.saturating_sub(t) >= self.cfg.lease)
            }
            Mode::Gba => self.step.accum_pushes as usize >= self.gba_k(),
            _ => false,
        }
    }

    /// GBA's K: the gradients a step takes, the live workers (the synchronous global batch).
    pub(super) fn gba_k(&self) -> usize {
        self.members.leases.len().max(1)
    }

    /// gba with `gba_lookahead`: pulls read the step in progress (dense chunks and embedding rows; a chunk
    /// held on a device is copied back to compute its preview).
    pub(super) fn gba_reads_ahead(&self) -> bool {
        self.mode.active == Mode::Gba && self.cfg.modes.gba_lookahead
    }

    /// Applies the averaged accumulated gradients as one update of every chunk that received some.
    pub(super) fn complete_step(&mut self) -> Result<(), ShardError> {
        let mut plan = Vec::new();
        let mut flat = Vec::new();
        // Rules that measure drift see none: every gradient of the step was computed on these values.
        let mut reads = Vec::new();
        for slot in 0..self.slots.len() {
            let count = self.step.accum_counts[slot];
            if count == 0 {
                continue;
            }
            let inv = 1.0 / count as f32;
            let tensor = self.slots[slot].tensor;
            let needs_read = self.tensor_rules[tensor as usize].0.layout().needs_read;
            let read_offset = needs_read.then_some(reads.len());
            if needs_read {
                self.read_params_into(slot, &mut reads)?;
            }
            plan.push(Planned { slot, tensor, offset: flat.len(), read_offset, staleness: 0 });
            flat.extend(self.step.accum[slot].iter().map(|g| g * inv));
            self.step.accum[slot].iter_mut().for_each(|g| *g = 0.0);
            self.step.accum_counts[slot] = 0;
        }
        let mode = self.mode.active;
        self.apply_now(&plan, u32::MAX, &flat, &reads)?;
        self.apply_rows(self.step.accum_pushes.max(1))?;
        self.step.global_step += 1;
        match mode {
            Mode::Gba => self.stats.steps_gba += 1,
            _ => self.stats.steps_sync += 1,
        }
        self.step.contributors.clear();
        self.step.step_started = None;
        self.step.accum_pushes = 0;
        self.step.ahead_values.clear();
        self.step.gba_hold.step_completed();
        Ok(())
    }
}

impl ShardCore {
    /// Applies the step's summed embedding-row gradients, each row once, divided by the step's `pushes`
    /// (the global batch's mean: every worker's row gradient is a mean over its own batch). Every gradient
    /// was checked against the row's version when it arrived, so the rows are updated as fresh (staleness
    /// 0); rules that measure drift see none.
    fn apply_rows(&mut self, pushes: u32) -> Result<(), ShardError> {
        let inv = 1.0 / pushes as f32;
        let multiplier = self.lr.scale * self.lr_multiplier() as f32;
        let now_s = self.now_s;
        let workers = self.worker_count();
        for t in 0..self.tables.len() {
            if self.step.row_accum[t].is_empty() {
                continue;
            }
            let (ids, mut sums) = self.step.row_accum[t].take();
            sums.iter_mut().for_each(|g| *g *= inv);
            let (rule, hyper) = self.table_rules[t];
            let table = &mut self.tables[t];
            let dim = table.config().dim as usize;
            let versions: Vec<u32> = ids.iter().map(|id| table.version(*id).unwrap_or(0)).collect();
            let mut reads = Vec::new();
            if rule.layout().needs_read {
                reads.reserve(ids.len() * dim);
                for id in &ids {
                    match table.row(*id) {
                        Some(row) => reads.extend_from_slice(row),
                        None => reads.resize(reads.len() + dim, 0.0),
                    }
                }
            }
            let lr = hyper.lr * multiplier;
            let base = PushScalars { lr, lr_max: lr.max(hyper.lr), staleness: 0, t: 1, workers };
            table
                .push(&ids, &versions, &sums, &reads, &hyper, base, now_s)
                .map_err(|e| ShardError::Device(e.to_string()))?;
        }
        Ok(())
    }
}
