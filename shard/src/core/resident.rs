//! Dense state resident on a device (issue 16): with [`ShardCore::make_resident`] the parameters and every
//! optimizer plane of the dense chunks move into the arenas of a [`gaps_kernels::resident::Resident`] (GPU
//! memory with `--device cuda`, host memory with [`gaps_kernels::resident::HostDevice`], which the tests
//! run the whole core over), allocated once. From then on the device holds the only copy: a push stages its
//! gradients (and echoes) once and applies one chunk table, a pull copies back what it reads, and
//! checkpoints, restores, synchronous steps and departures read or write the device chunk by chunk. The
//! host keeps the chunks' lengths and versions, and, per chunk, which workers hold a per-worker plane
//! (empty markers, so a checkpoint names exactly the planes the host path would).
//!
//! Per-worker planes live in a fixed number of stripes (`worker_slots`, chosen when the state moves): a
//! worker takes a stripe at its first push that needs one and gives it back when it leaves or its lease
//! ends. One stripe is set aside for the synchronous modes' aggregated step. Sparse tables stay on the host.

use super::*;
use gaps_kernels::resident::{Device, Lookahead, PushBatch, Resident, ResidentState};

/// The aggregated update of a synchronous or GBA step is applied as this worker.
pub(super) const STEP_WORKER: u32 = u32::MAX;

/// Which worker holds which stripe of the worker arena.
#[derive(Debug, Default)]
pub(super) struct WorkerStripes {
    held: HashMap<u32, u32>,
    /// Free stripes, the lowest last (taken first).
    free: Vec<u32>,
}

impl WorkerStripes {
    fn new(stripes: u32) -> Self {
        WorkerStripes { held: HashMap::new(), free: (0..stripes).rev().collect() }
    }

    /// The stripe `worker` holds, if any.
    pub(super) fn of(&self, worker: u32) -> Option<u32> {
        self.held.get(&worker).copied()
    }

    /// True when `worker` holds a stripe or one is free for it.
    pub(super) fn can_take(&self, worker: u32) -> bool {
        self.held.contains_key(&worker) || !self.free.is_empty()
    }

    /// The stripe of `worker`, taking a free one at its first use.
    fn take(&mut self, worker: u32) -> Result<u32, ShardError> {
        if let Some(s) = self.held.get(&worker) {
            return Ok(*s);
        }
        let stripe = self.free.pop().ok_or_else(|| exhausted(self.held.len()))?;
        self.held.insert(worker, stripe);
        Ok(stripe)
    }

    /// Gives `worker`'s stripe back (`reusable`: its planes were zeroed; otherwise the stripe is retired).
    fn release(&mut self, worker: u32, reusable: bool) {
        if let Some(stripe) = self.held.remove(&worker) {
            if reusable {
                self.free.push(stripe);
                self.free.sort_unstable_by(|a, b| b.cmp(a));
            }
        }
    }

    pub(super) fn held(&self) -> usize {
        self.held.len()
    }
}

/// The refusal of a push from one worker more than the device's stripes hold.
pub(super) fn exhausted(held: usize) -> ShardError {
    ShardError::Misconfigured(format!(
        "the device holds per-worker optimizer planes for {held} workers and has no room for another: \
         restart the shard with a larger --device-worker-slots"
    ))
}

fn device_err(e: gaps_kernels::KernelError) -> ShardError {
    ShardError::Device(e.to_string())
}

impl ShardCore {
    /// Moves the dense state onto `device`: every chunk's parameters and optimizer planes (per-worker
    /// planes in `worker_slots` stripes, one of them for synchronous steps) are allocated there once and
    /// loaded, and the host copies are dropped. A restored shard moves the checkpoint's state. Refused, with
    /// nothing changed, when the device cannot hold it or the state has more workers' planes than stripes.
    pub fn make_resident<D>(&mut self, device: D, worker_slots: u32) -> Result<(), ShardError>
    where
        D: Device + std::fmt::Debug + Send + 'static,
        D::Buf: std::fmt::Debug + Send,
    {
        if self.resident.is_some() {
            return Err(ShardError::Misconfigured("the dense state is already resident on a device".into()));
        }
        let rules: Vec<(u32, Rule)> = self
            .slots
            .iter()
            .map(|s| Ok((u32::try_from(s.len).map_err(|_| too_long(s.len))?, self.tensor_rules[s.tensor as usize].0)))
            .collect::<Result<_, ShardError>>()?;
        let any_worker_planes = rules.iter().any(|(_, r)| r.layout().worker_planes > 0);
        if any_worker_planes && worker_slots < 2 {
            return Err(ShardError::Misconfigured(
                "--device-worker-slots must be at least 2 for rules with per-worker state (one is the synchronous step's)"
                    .into(),
            ));
        }
        let layout = gaps_kernels::plan::DeviceLayout::new(&rules, worker_slots).map_err(device_err)?;
        let mut stripes = WorkerStripes::new(if any_worker_planes { worker_slots } else { 0 });
        if any_worker_planes {
            stripes.take(STEP_WORKER)?;
        }
        let mut resident = Resident::new(device, layout).map_err(device_err)?;
        for (chunk, slot) in self.slots.iter().enumerate() {
            let planes: Vec<&[f32]> = if slot.len == 0 { Vec::new() } else { slot.shared.chunks(slot.len).collect() };
            resident.load_chunk(chunk, &slot.params[..], &planes, &[]).map_err(device_err)?;
            let mut workers: Vec<_> = slot.workers.iter().collect();
            workers.sort_by_key(|(w, _)| **w);
            for (worker, plane) in workers {
                let stripe = stripes.take(*worker)?;
                resident.load_worker(chunk, stripe, plane).map_err(device_err)?;
            }
        }
        // The device holds the only copy from here on.
        for slot in &mut self.slots {
            slot.params = Arc::default();
            slot.shared = Vec::new();
            slot.workers.values_mut().for_each(|plane| *plane = Vec::new());
        }
        self.resident = Some(Box::new(resident));
        self.stripes = stripes;
        Ok(())
    }

    /// Where the dense state lives: "host" (the shard's own planes) or the resident device's name.
    pub fn dense_device(&self) -> String {
        self.resident.as_ref().map_or_else(|| "host".into(), |r| r.device_name())
    }

    /// Bytes the resident state copied to its device and back for pushes and pulls (0, 0 on the host path).
    pub fn device_bytes(&self) -> (u64, u64) {
        self.resident.as_ref().map_or((0, 0), |r| (r.bytes_to_device(), r.bytes_to_host()))
    }

    /// Applies a push's planned chunks on the resident device: the stripe of `worker`, one chunk table.
    pub(super) fn apply_resident(
        &mut self,
        plan: &[Planned],
        worker: u32,
        grads: &[f32],
        reads: &[f32],
        lrs: &[f32],
        worker_count: u32,
    ) -> Result<(), ShardError> {
        let needs_stripe = plan.iter().any(|p| self.tensor_rules[p.tensor as usize].0.layout().worker_planes > 0);
        let stripe = if needs_stripe { self.stripes.take(worker)? } else { 0 };
        let mut chunks = Vec::with_capacity(plan.len());
        let mut hypers = Vec::with_capacity(plan.len());
        let mut scalars = Vec::with_capacity(plan.len());
        let (mut grad_at, mut read_at) = (0, 0);
        for p in plan {
            let t = p.tensor as usize;
            let slot = &self.slots[p.slot];
            // The staged layout is every gradient in plan order, then the echoes in the same order.
            if p.offset != grad_at || p.read_offset.is_some_and(|r| r != read_at) {
                return Err(ShardError::Device("a push's sections are out of the plan's order".into()));
            }
            grad_at += slot.len;
            read_at += p.read_offset.map_or(0, |_| slot.len);
            chunks.push(p.slot);
            hypers.push(self.tensor_rules[t].1);
            scalars.push(PushScalars {
                lr: lrs[t],
                lr_max: self.lr.max[t],
                staleness: p.staleness,
                t: slot.version + 1,
                workers: worker_count,
            });
        }
        let (grads, reads) = (&grads[..grad_at.min(grads.len())], &reads[..read_at.min(reads.len())]);
        let resident = self.resident.as_mut().ok_or_else(|| ShardError::Device("no resident state".into()))?;
        resident
            .push(PushBatch { chunks: &chunks, worker_slot: stripe, hypers: &hypers, scalars: &scalars, grads, reads })
            .map_err(device_err)?;
        if needs_stripe {
            for p in plan {
                if self.tensor_rules[p.tensor as usize].0.layout().worker_planes > 0 {
                    self.slots[p.slot].workers.entry(worker).or_default();
                }
            }
        }
        Ok(())
    }

    /// Appends chunk slot `slot`'s parameters to `out`, from wherever they live.
    pub(super) fn read_params_into(&self, slot: usize, out: &mut Vec<f32>) -> Result<(), ShardError> {
        match &self.resident {
            None => {
                out.extend_from_slice(&self.slots[slot].params);
                Ok(())
            }
            Some(r) => r.read_params(slot, out).map_err(device_err),
        }
    }

    /// Whether a pull of chunk slot `slot` reads the parameters as the host holds them (no look-ahead to
    /// compute, no device to copy from), so a reply can be made straight from them.
    pub(super) fn reads_params_in_place(&self, slot: usize) -> bool {
        self.resident.is_none() && !self.tensor_rules[self.slots[slot].tensor as usize].0.layout().lookahead
    }

    /// Appends what a pull of chunk slot `slot` reads (parameters or DANA's look-ahead) to `out`.
    pub(super) fn pull_into(&mut self, slot: usize, out: &mut Vec<f32>) -> Result<(), ShardError> {
        self.pull_many_into(&[slot], out)
    }

    /// [`Self::pull_into`] for each of `slots`, one after the other; from a device, every chunk's copy in
    /// one go (one wait for the lot, not one a chunk).
    pub(super) fn pull_many_into(&mut self, slots: &[usize], out: &mut Vec<f32>) -> Result<(), ShardError> {
        let workers = self.worker_count();
        // The rule, hyper-parameters and learning rate of a chunk's tensor.
        let rate = |core: &Self, slot: usize| {
            let tensor = core.slots[slot].tensor;
            let (rule, hyper) = core.tensor_rules[tensor as usize];
            (rule, hyper, core.tensor_lr(tensor))
        };
        if self.resident.is_none() {
            for &slot in slots {
                let (rule, hyper, lr) = rate(self, slot);
                let s = &self.slots[slot];
                gaps_kernels::pull_values(rule, &hyper, lr, workers, &s.params, &s.shared, out);
            }
            return Ok(());
        }
        let hypers: Vec<(gaps_kernels::Hyper, f32)> =
            slots.iter().map(|&slot| rate(self, slot)).map(|(_, hyper, lr)| (hyper, lr)).collect();
        let looks: Vec<Lookahead<'_>> =
            hypers.iter().map(|(hyper, lr)| Lookahead { hyper, lr: *lr, workers }).collect();
        let r = self.resident.as_mut().ok_or_else(|| ShardError::Device("no resident state".into()))?;
        r.pull(slots, &looks, out).map_err(device_err)
    }

    /// Reads chunk slot `slot`'s parameters and shared planes (one after the other) from the device into
    /// `params` and `shared` (cleared first), for a checkpoint.
    pub(super) fn resident_planes(
        &self,
        slot: usize,
        params: &mut Vec<f32>,
        shared: &mut Vec<f32>,
    ) -> Result<(), ShardError> {
        let r = self.resident.as_ref().ok_or_else(|| ShardError::Device("no resident state".into()))?;
        params.clear();
        shared.clear();
        r.read_params(slot, params).map_err(device_err)?;
        r.read_shared(slot, shared).map_err(device_err)
    }

    /// Appends `worker`'s plane of chunk slot `slot` to `out`, from the device.
    pub(super) fn resident_worker_plane(&self, slot: usize, worker: u32, out: &mut Vec<f32>) -> Result<(), ShardError> {
        let r = self.resident.as_ref().ok_or_else(|| ShardError::Device("no resident state".into()))?;
        let stripe = self
            .stripes
            .of(worker)
            .ok_or_else(|| ShardError::Device(format!("worker {worker} has planes but no stripe on the device")))?;
        r.read_worker(slot, stripe, out).map_err(device_err)
    }

    /// Drops `worker`'s per-worker planes on the device (taking them out of DANA's sum first) and frees its
    /// stripe. When the device fails, the stripe is retired rather than handed to another worker unzeroed.
    pub(super) fn release_resident_worker(&mut self, worker: u32) -> Result<(), ShardError> {
        for slot in &mut self.slots {
            slot.workers.remove(&worker);
        }
        let Some(stripe) = self.stripes.of(worker) else { return Ok(()) };
        let r = self.resident.as_mut().ok_or_else(|| ShardError::Device("no resident state".into()))?;
        let released = r.release_worker(stripe).map_err(device_err);
        self.stripes.release(worker, released.is_ok());
        released
    }
}

fn too_long(len: usize) -> ShardError {
    ShardError::Misconfigured(format!("a chunk of {len} floats is too long for the device layout"))
}
