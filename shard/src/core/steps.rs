//! Synchronous steps: sync (BSP) and GBA accumulation and completion, SSP clocks, and `auto`'s switching
//! between sync and gba on the straggler detector's verdict.

use super::*;

impl ShardCore {
    /// Lets the detector judge the live workers and, in `auto`, switches between sync and gba.
    pub(super) fn judge(&mut self, events: &mut Vec<CoreEvent>) {
        let live: BTreeSet<u32> = self.leases.keys().copied().collect();
        let reasons = self.detector.judge(&live, &self.cfg.modes);
        if self.cfg.modes.mode != Mode::Auto {
            return;
        }
        let wanted = if self.detector.stragglers().is_empty() { Mode::Sync } else { Mode::Gba };
        if wanted != self.active {
            let reason = if reasons.is_empty() { "membership changed".to_string() } else { reasons.join("; ") };
            if self.active == Mode::Gba && self.accum_pushes > 0 {
                // The partial GBA step is applied as it is; sync starts on a fresh step.
                let _ = self.complete_step();
            }
            events.push(CoreEvent::ModeSwitch { from: self.active, to: wanted, reason });
            self.active = wanted;
            self.stats.mode_switches += 1;
        }
    }

    pub(super) fn min_clock(&self) -> u64 {
        self.leases.keys().map(|w| self.clocks.get(w).copied().unwrap_or(0)).min().unwrap_or(0)
    }

    /// A synchronous step is complete when every live worker contributed (sync) or K = live workers
    /// gradients arrived (gba).
    pub(super) fn step_ready(&self) -> bool {
        if self.accum_pushes == 0 {
            return false;
        }
        match self.active {
            Mode::Sync => self.leases.keys().all(|w| self.contributors.contains(w)),
            Mode::Gba => self.accum_pushes as usize >= self.leases.len().max(1),
            _ => false,
        }
    }

    /// Applies the averaged accumulated gradients as one update of every chunk that received some.
    pub(super) fn complete_step(&mut self) -> Result<(), ShardError> {
        let mut plan = Vec::new();
        let mut flat = Vec::new();
        // Rules that measure drift see none: every gradient of the step was computed on these values.
        let mut reads = Vec::new();
        for slot in 0..self.slots.len() {
            let count = self.accum_counts[slot];
            if count == 0 {
                continue;
            }
            let inv = 1.0 / count as f32;
            let tensor = self.slots[slot].tensor;
            let needs_read = self.tensor_rules[tensor as usize].0.layout().needs_read;
            let read_offset = needs_read.then_some(reads.len());
            if needs_read {
                reads.extend_from_slice(&self.slots[slot].params);
            }
            plan.push(Planned { slot, tensor, offset: flat.len(), read_offset, staleness: 0 });
            flat.extend(self.accum[slot].iter().map(|g| g * inv));
            self.accum[slot].iter_mut().for_each(|g| *g = 0.0);
            self.accum_counts[slot] = 0;
        }
        let mode = self.active;
        self.apply_now(&plan, u32::MAX, &flat, &reads)?;
        self.global_step += 1;
        match mode {
            Mode::Gba => self.stats.steps_gba += 1,
            _ => self.stats.steps_sync += 1,
        }
        self.contributors.clear();
        self.accum_pushes = 0;
        Ok(())
    }
}
