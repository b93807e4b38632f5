//! A shard's dense state resident where its updates run (issue 16 part 1): the arenas of a
//! [`DeviceLayout`] allocated once, each push staged in one buffer allocated once and applied by one pass
//! over its chunk table, each pull copying back only what it reads. [`Resident`] follows the plans of
//! [`crate::plan`] on any [`Device`]: [`HostDevice`] keeps the arenas in host memory and runs the CPU
//! kernels (what the tests check the executor with, against the plain per-chunk path), and
//! [`crate::cuda::CudaArenas`] keeps them in GPU memory, stages pushes in pinned memory and launches
//! `rules.cu`'s `gaps_update_table` (compiled by NVRTC in CI; run only where a GPU is present).
//!
//! What crosses to the device per push is exactly the staged gradient and, for rules that measure drift,
//! the read echo ([`Resident::bytes_to_device`] counts it); optimizer state never crosses except when a
//! checkpoint reads it ([`Resident::read_chunk`]) or a restore loads it ([`Resident::load_chunk`]).
//! DANA's look-ahead is computed on the host from the copied parameters and momentum plane (one more plane
//! copied per pull for those rules).

use crate::plan::{DeviceLayout, PushPlan, TableEntry};
use crate::{derive, Derived, Hyper, KernelError, PushScalars, Rule};

/// One entry of a push's chunk table with the scalars its rule reads.
#[derive(Debug, Clone, Copy)]
pub struct Launch {
    /// Where the chunk's state, gradient and echo sit.
    pub entry: TableEntry,
    pub(crate) k: Derived,
}

/// The arenas of a layout on one device (a plane no chunk uses holds one unused float).
#[derive(Debug)]
pub struct Arenas<B> {
    /// θ.
    pub params: B,
    /// Shared planes 0 and 1.
    pub s0: B,
    /// See `s0`.
    pub s1: B,
    /// Per-worker planes, one stripe per worker slot.
    pub worker: B,
}

/// [`Device::download_many`] one [`Device::download`] a copy (a device's default, and a GPU's way for a
/// small pull); refused when `dst` is not as long as the copies together.
pub(crate) fn download_each<D: Device + ?Sized>(
    device: &D,
    src: &D::Buf,
    copies: &[(u64, usize)],
    dst: &mut [f32],
) -> Result<(), KernelError> {
    let total: usize = copies.iter().map(|(_, len)| len).sum();
    if total != dst.len() {
        return Err(internal(format!("{total} floats to download into {}", dst.len())));
    }
    let mut at = 0;
    for &(offset, len) in copies {
        device.download(src, offset, &mut dst[at..at + len])?;
        at += len;
    }
    Ok(())
}

/// Where the arenas live and the chunk-table update runs.
pub trait Device {
    /// A buffer of floats on the device.
    type Buf;
    /// For logs and bench tables.
    fn name(&self) -> String;
    /// Sets aside what pushes reuse: a staging buffer of `staging_floats` (pinned host memory on a GPU) and
    /// room for a chunk table of `table_entries`. Called once, when the state is laid out.
    fn reserve(&mut self, staging_floats: u64, table_entries: usize) -> Result<(), KernelError> {
        let _ = (staging_floats, table_entries);
        Ok(())
    }
    /// `floats` zeroed floats (called only when the state is laid out).
    fn alloc_zeroed(&mut self, floats: u64) -> Result<Self::Buf, KernelError>;
    /// Copies `src` to `dst` from float `offset` on.
    fn upload(&mut self, src: &[f32], dst: &mut Self::Buf, offset: u64) -> Result<(), KernelError>;
    /// Copies `dst.len()` floats of `src` from float `offset` on into `dst` (complete when it returns).
    fn download(&self, src: &Self::Buf, offset: u64, dst: &mut [f32]) -> Result<(), KernelError>;
    /// Copies the floats of `src` at each `(offset, len)` of `copies`, one after the other, into `dst` (as
    /// long as all of them; complete when it returns): a pull's chunks. A GPU queues every copy into a
    /// page-locked buffer and waits once, where one [`Device::download`] a chunk waits once a chunk.
    fn download_many(&self, src: &Self::Buf, copies: &[(u64, usize)], dst: &mut [f32]) -> Result<(), KernelError> {
        download_each(self, src, copies, dst)
    }
    /// Copies `parts`, one after the other, to the start of `staging` (a push's gradients, then its
    /// echoes). A GPU copies them into its pinned buffer and moves them in one transfer.
    fn stage(&mut self, parts: &[&[f32]], staging: &mut Self::Buf) -> Result<(), KernelError> {
        let mut at = 0u64;
        for part in parts {
            self.upload(part, staging, at)?;
            at += part.len() as u64;
        }
        Ok(())
    }
    /// Applies every entry of `table` to the arenas, gradients and echoes read from `staged`.
    fn apply_table(
        &mut self,
        table: &[Launch],
        arenas: &mut Arenas<Self::Buf>,
        staged: &Self::Buf,
    ) -> Result<(), KernelError>;
}

/// A shard's dense state on a device, with its staging buffer.
#[derive(Debug)]
pub struct Resident<D: Device> {
    device: D,
    layout: DeviceLayout,
    arenas: Arenas<D::Buf>,
    staging: D::Buf,
    staging_floats: u64,
    to_device: u64,
    to_host: u64,
}

fn internal(message: String) -> KernelError {
    KernelError::Internal(message)
}

impl<D: Device> Resident<D> {
    /// Allocates every arena of `layout` and a staging buffer for the largest push (every chunk's gradient
    /// and echo), all zeroed; nothing is allocated afterwards.
    pub fn new(mut device: D, layout: DeviceLayout) -> Result<Self, KernelError> {
        let sizes = layout.arena_sizes();
        let mut alloc = |n: u64| device.alloc_zeroed(n.max(1));
        let arenas = Arenas {
            params: alloc(sizes.params)?,
            s0: alloc(sizes.shared[0])?,
            s1: alloc(sizes.shared[1])?,
            worker: alloc(sizes.worker)?,
        };
        let all: Vec<usize> = (0..layout.slots().len()).collect();
        let staging_floats = layout.push_plan(&all, 0).map(|p| p.staged_floats).unwrap_or(0).max(1);
        let staging = device.alloc_zeroed(staging_floats)?;
        device.reserve(staging_floats, all.len())?;
        Ok(Resident { device, layout, arenas, staging, staging_floats, to_device: 0, to_host: 0 })
    }

    fn chunk_planes(&self, chunk: usize) -> Result<(u64, usize, Rule), KernelError> {
        let slot = self.layout.slots().get(chunk).ok_or_else(|| internal(format!("no chunk {chunk}")))?;
        Ok((slot.offset, slot.len as usize, slot.rule))
    }

    /// Loads one chunk's state (initial values, or a checkpoint's): its parameters, its shared planes (as
    /// many as its rule keeps, each of the chunk's length) and its per-worker planes (one per worker slot).
    pub fn load_chunk(
        &mut self,
        chunk: usize,
        params: &[f32],
        shared: &[&[f32]],
        worker: &[&[f32]],
    ) -> Result<(), KernelError> {
        let (offset, n, rule) = self.chunk_planes(chunk)?;
        let l = rule.layout();
        let ok = params.len() == n
            && shared.len() == l.shared_planes
            && shared.iter().all(|s| s.len() == n)
            && (l.worker_planes == 0 || worker.iter().all(|w| w.len() == n));
        if !ok {
            return Err(internal(format!("chunk {chunk}: state of the wrong shape for {rule}")));
        }
        self.device.upload(params, &mut self.arenas.params, offset)?;
        for (k, plane) in shared.iter().enumerate() {
            let arena = if k == 0 { &mut self.arenas.s0 } else { &mut self.arenas.s1 };
            self.device.upload(plane, arena, offset)?;
        }
        if l.worker_planes > 0 {
            let total = self.layout.arena_sizes().params;
            for (w, plane) in worker.iter().enumerate() {
                self.device.upload(plane, &mut self.arenas.worker, w as u64 * total + offset)?;
            }
        }
        Ok(())
    }

    /// Reads one chunk's state back (for a checkpoint): parameters, shared planes, per-worker planes, in the
    /// shapes [`Self::load_chunk`] takes.
    #[allow(clippy::type_complexity)]
    pub fn read_chunk(
        &self,
        chunk: usize,
        worker_slots: u32,
    ) -> Result<(Vec<f32>, Vec<Vec<f32>>, Vec<Vec<f32>>), KernelError> {
        let (offset, n, rule) = self.chunk_planes(chunk)?;
        let l = rule.layout();
        let mut params = vec![0.0; n];
        self.device.download(&self.arenas.params, offset, &mut params)?;
        let mut shared = vec![vec![0.0; n]; l.shared_planes];
        for (k, plane) in shared.iter_mut().enumerate() {
            self.device.download(if k == 0 { &self.arenas.s0 } else { &self.arenas.s1 }, offset, plane)?;
        }
        let total = self.layout.arena_sizes().params;
        let stripes = if l.worker_planes > 0 { worker_slots as usize } else { 0 };
        let mut worker = vec![vec![0.0; n]; stripes];
        for (w, plane) in worker.iter_mut().enumerate() {
            self.device.download(&self.arenas.worker, w as u64 * total + offset, plane)?;
        }
        Ok((params, shared, worker))
    }

    /// Where worker slot `stripe`'s plane of `chunk` sits in the worker arena (None when its rule keeps no
    /// per-worker plane).
    fn worker_at(&self, chunk: usize, stripe: u32) -> Result<Option<(u64, usize)>, KernelError> {
        let (offset, n, rule) = self.chunk_planes(chunk)?;
        if rule.layout().worker_planes == 0 {
            return Ok(None);
        }
        if stripe >= self.layout.worker_slots() {
            return Err(internal(format!("worker slot {stripe} of {}", self.layout.worker_slots())));
        }
        Ok(Some((u64::from(stripe) * self.layout.arena_sizes().params + offset, n)))
    }
}

/// One push for [`ResidentState::push`]: `grads` holds every chunk's gradient in the order of `chunks`,
/// `reads` the echo of each chunk whose rule needs one, in the same order (the plan's staging layout);
/// `hypers` and `scalars` one per chunk.
#[derive(Debug, Clone, Copy)]
pub struct PushBatch<'a> {
    /// Layout indices of the chunks pushed.
    pub chunks: &'a [usize],
    /// The pushing worker's slot.
    pub worker_slot: u32,
    /// Each chunk's hyper-parameters.
    pub hypers: &'a [Hyper],
    /// Each chunk's per-push scalars.
    pub scalars: &'a [PushScalars],
    /// The gradients.
    pub grads: &'a [f32],
    /// The echoes.
    pub reads: &'a [f32],
}

/// What a pull needs to compute DANA's look-ahead ([`crate::pull_values`]) where a chunk's rule has one.
#[derive(Debug, Clone, Copy)]
pub struct Lookahead<'a> {
    /// The chunk's hyper-parameters.
    pub hyper: &'a Hyper,
    /// The learning rate in force.
    pub lr: f32,
    /// Live workers.
    pub workers: u32,
}

/// A [`Resident`] on whichever device was chosen at run time (what a shard holds): the same operations,
/// object-safe.
pub trait ResidentState: std::fmt::Debug + Send {
    /// The device's name.
    fn device_name(&self) -> String;
    /// The layout the state follows.
    fn layout(&self) -> &DeviceLayout;
    /// Bytes copied to the device by pushes and pulls so far (loads and checkpoint reads not counted).
    fn bytes_to_device(&self) -> u64;
    /// Bytes copied back to the host by pulls so far.
    fn bytes_to_host(&self) -> u64;
    /// See [`Resident::load_chunk`] (parameters and shared planes; worker planes with `load_worker`).
    fn load_chunk(&mut self, chunk: usize, params: &[f32], shared: &[&[f32]]) -> Result<(), KernelError>;
    /// One chunk's parameters (a checkpoint's or a synchronous step's read), appended to `out`.
    fn read_params(&self, chunk: usize, out: &mut Vec<f32>) -> Result<(), KernelError>;
    /// Appends `chunk`'s shared planes, one after the other, to `out`.
    fn read_shared(&self, chunk: usize, out: &mut Vec<f32>) -> Result<(), KernelError>;
    /// Replaces one chunk's parameters (its optimizer state stays).
    fn load_params(&mut self, chunk: usize, params: &[f32]) -> Result<(), KernelError>;
    /// Appends worker slot `stripe`'s plane of `chunk` to `out` (nothing for rules without one).
    fn read_worker(&self, chunk: usize, stripe: u32, out: &mut Vec<f32>) -> Result<(), KernelError>;
    /// Loads worker slot `stripe`'s plane of `chunk` (a restore).
    fn load_worker(&mut self, chunk: usize, stripe: u32, plane: &[f32]) -> Result<(), KernelError>;
    /// Frees worker slot `stripe` for another worker: its planes are zeroed and, under the rules with a
    /// look-ahead, first taken out of the shared sum (plane 0), as the host path forgets a worker.
    fn release_worker(&mut self, stripe: u32) -> Result<(), KernelError>;
    /// Applies a push of `chunks` (layout indices) by `worker_slot`: `grads` holds every chunk's gradient in
    /// the order of `chunks`, `reads` the echo of each chunk whose rule needs one, in the same order (the
    /// plan's staging layout); `hypers` and `scalars` one per chunk. One copy to the device and one pass over
    /// the chunk table; returns the plan followed.
    fn push(&mut self, batch: PushBatch<'_>) -> Result<PushPlan, KernelError>;
    /// Appends what a pull of `chunks` reads to `out`: each chunk's parameters, or DANA's look-ahead
    /// (computed here from the copied parameters and momentum plane, as `crate::pull_values` does, in place)
    /// with the chunk's own entry of `lookaheads` (one per chunk). Every chunk's copy in one go.
    fn pull(&mut self, chunks: &[usize], lookaheads: &[Lookahead<'_>], out: &mut Vec<f32>) -> Result<(), KernelError>;
}

impl<D> ResidentState for Resident<D>
where
    D: Device + std::fmt::Debug + Send,
    D::Buf: std::fmt::Debug + Send,
{
    fn device_name(&self) -> String {
        self.device.name()
    }
    fn layout(&self) -> &DeviceLayout {
        &self.layout
    }
    fn bytes_to_device(&self) -> u64 {
        self.to_device
    }
    fn bytes_to_host(&self) -> u64 {
        self.to_host
    }
    fn load_chunk(&mut self, chunk: usize, params: &[f32], shared: &[&[f32]]) -> Result<(), KernelError> {
        Resident::load_chunk(self, chunk, params, shared, &[])
    }
    fn read_params(&self, chunk: usize, out: &mut Vec<f32>) -> Result<(), KernelError> {
        let (offset, n, _) = self.chunk_planes(chunk)?;
        let start = out.len();
        out.resize(start + n, 0.0);
        self.device.download(&self.arenas.params, offset, &mut out[start..])
    }
    fn read_shared(&self, chunk: usize, out: &mut Vec<f32>) -> Result<(), KernelError> {
        let (offset, n, rule) = self.chunk_planes(chunk)?;
        for k in 0..rule.layout().shared_planes {
            let start = out.len();
            out.resize(start + n, 0.0);
            self.device.download(if k == 0 { &self.arenas.s0 } else { &self.arenas.s1 }, offset, &mut out[start..])?;
        }
        Ok(())
    }
    fn load_params(&mut self, chunk: usize, params: &[f32]) -> Result<(), KernelError> {
        let (offset, n, _) = self.chunk_planes(chunk)?;
        if params.len() != n {
            return Err(internal(format!("chunk {chunk} has {n} values, got {}", params.len())));
        }
        self.device.upload(params, &mut self.arenas.params, offset)
    }
    fn read_worker(&self, chunk: usize, stripe: u32, out: &mut Vec<f32>) -> Result<(), KernelError> {
        let Some((at, n)) = self.worker_at(chunk, stripe)? else { return Ok(()) };
        let start = out.len();
        out.resize(start + n, 0.0);
        self.device.download(&self.arenas.worker, at, &mut out[start..])
    }
    fn load_worker(&mut self, chunk: usize, stripe: u32, plane: &[f32]) -> Result<(), KernelError> {
        let Some((at, n)) = self.worker_at(chunk, stripe)? else {
            return Err(internal(format!("chunk {chunk}'s rule keeps no per-worker plane")));
        };
        if plane.len() != n {
            return Err(internal(format!("chunk {chunk} has {n} values, its worker plane {}", plane.len())));
        }
        self.device.upload(plane, &mut self.arenas.worker, at)
    }
    fn release_worker(&mut self, stripe: u32) -> Result<(), KernelError> {
        let mut plane = Vec::new();
        let mut shared = Vec::new();
        for chunk in 0..self.layout.slots().len() {
            let Some((at, n)) = self.worker_at(chunk, stripe)? else { continue };
            let (offset, _, rule) = self.chunk_planes(chunk)?;
            plane.clear();
            plane.resize(n, 0.0);
            self.device.download(&self.arenas.worker, at, &mut plane)?;
            if rule.layout().lookahead {
                shared.clear();
                shared.resize(n, 0.0);
                self.device.download(&self.arenas.s0, offset, &mut shared)?;
                shared.iter_mut().zip(&plane).for_each(|(s, v)| *s -= v);
                self.device.upload(&shared, &mut self.arenas.s0, offset)?;
            }
            plane.iter_mut().for_each(|v| *v = 0.0);
            self.device.upload(&plane, &mut self.arenas.worker, at)?;
        }
        Ok(())
    }
    fn push(&mut self, batch: PushBatch<'_>) -> Result<PushPlan, KernelError> {
        let PushBatch { chunks, worker_slot, hypers, scalars, grads, reads } = batch;
        let plan = self.layout.push_plan(chunks, worker_slot)?;
        let staged = (grads.len() + reads.len()) as u64;
        if staged != plan.staged_floats || plan.staged_floats > self.staging_floats {
            return Err(internal(format!("a push stages {staged} floats, its plan {}", plan.staged_floats)));
        }
        let grad_floats: u64 = plan.table.iter().map(|e| u64::from(e.len)).sum();
        if grads.len() as u64 != grad_floats {
            return Err(internal(format!("a push carries {} gradient floats, its chunks {grad_floats}", grads.len())));
        }
        if scalars.len() != chunks.len() || hypers.len() != chunks.len() {
            return Err(internal(format!(
                "{} chunks, {} sets of scalars, {} of hyper-parameters",
                chunks.len(),
                scalars.len(),
                hypers.len()
            )));
        }
        self.device.stage(&[grads, reads], &mut self.staging)?;
        self.to_device += 4 * staged;
        let table: Vec<Launch> = plan
            .table
            .iter()
            .zip(scalars.iter().zip(hypers))
            .map(|(entry, (s, h))| Launch { entry: *entry, k: derive(Rule::ALL[entry.rule as usize], h, s) })
            .collect();
        self.device.apply_table(&table, &mut self.arenas, &self.staging)?;
        Ok(plan)
    }
    fn pull(&mut self, chunks: &[usize], lookaheads: &[Lookahead<'_>], out: &mut Vec<f32>) -> Result<(), KernelError> {
        if lookaheads.len() != chunks.len() {
            return Err(internal(format!("a pull of {} chunks with {} look-aheads", chunks.len(), lookaheads.len())));
        }
        let plan = self.layout.pull_plan(chunks)?;
        // Every chunk's parameters in one go, and the momentum of those a look-ahead reads in another.
        let copies: Vec<(u64, usize)> = plan.copies.iter().map(|&(offset, len, _)| (offset, len as usize)).collect();
        let total: usize = copies.iter().map(|(_, len)| len).sum();
        let ahead: Vec<(u64, usize)> = plan
            .copies
            .iter()
            .filter(|(_, _, lookahead)| *lookahead)
            .map(|&(offset, len, _)| (offset, len as usize))
            .collect();
        let start = out.len();
        out.resize(start + total, 0.0);
        self.device.download_many(&self.arenas.params, &copies, &mut out[start..])?;
        self.to_host += 4 * total as u64;
        if ahead.is_empty() {
            return Ok(());
        }
        let mut momentum = vec![0.0; ahead.iter().map(|(_, len)| len).sum()];
        self.device.download_many(&self.arenas.s0, &ahead, &mut momentum)?;
        self.to_host += 4 * momentum.len() as u64;
        // The look-ahead chunks' values read from their parameters and momentum, in place.
        let (mut at, mut m) = (start, 0);
        for ((&chunk, &(_, len, lookahead)), look) in chunks.iter().zip(&plan.copies).zip(lookaheads) {
            let n = len as usize;
            if lookahead {
                let rule = self.layout.slots()[chunk].rule;
                let Lookahead { hyper, lr, workers } = *look;
                crate::look_ahead(rule, hyper, lr, workers, &mut out[at..at + n], &momentum[m..m + n]);
                m += n;
            }
            at += n;
        }
        Ok(())
    }
}

/// Arenas in host memory, updated by the CPU kernels: the executor's reference and test device.
#[derive(Debug, Default)]
pub struct HostDevice;

impl Device for HostDevice {
    type Buf = Vec<f32>;

    fn name(&self) -> String {
        "host".into()
    }

    fn alloc_zeroed(&mut self, floats: u64) -> Result<Vec<f32>, KernelError> {
        let n = usize::try_from(floats).map_err(|_| internal(format!("{floats} floats do not fit in memory")))?;
        Ok(vec![0.0; n])
    }

    fn upload(&mut self, src: &[f32], dst: &mut Vec<f32>, offset: u64) -> Result<(), KernelError> {
        let at = offset as usize;
        let to = dst.get_mut(at..at + src.len()).ok_or_else(|| internal("an upload past its buffer".into()))?;
        to.copy_from_slice(src);
        Ok(())
    }

    fn download(&self, src: &Vec<f32>, offset: u64, dst: &mut [f32]) -> Result<(), KernelError> {
        let at = offset as usize;
        let from = src.get(at..at + dst.len()).ok_or_else(|| internal("a download past its buffer".into()))?;
        dst.copy_from_slice(from);
        Ok(())
    }

    fn apply_table(
        &mut self,
        table: &[Launch],
        arenas: &mut Arenas<Vec<f32>>,
        staged: &Vec<f32>,
    ) -> Result<(), KernelError> {
        for launch in table {
            let e = &launch.entry;
            let rule = Rule::ALL[e.rule as usize];
            let l = rule.layout();
            let n = e.len as usize;
            let range = |offset: u64, used: bool| if used { offset as usize..offset as usize + n } else { 0..0 };
            let (p, w) = (range(e.param_offset, true), range(e.worker_offset, l.worker_planes > 0));
            let (s0, s1) = (range(e.param_offset, l.shared_planes > 0), range(e.param_offset, l.shared_planes > 1));
            let (g, r) = (range(e.grad_offset, true), range(e.read_offset, l.needs_read));
            let bufs = crate::Bufs {
                params: arenas.params.get_mut(p).ok_or_else(|| internal("an entry past the arena".into()))?,
                s0: arenas.s0.get_mut(s0).ok_or_else(|| internal("an entry past the arena".into()))?,
                s1: arenas.s1.get_mut(s1).ok_or_else(|| internal("an entry past the arena".into()))?,
                w0: arenas.worker.get_mut(w).ok_or_else(|| internal("an entry past the arena".into()))?,
                grad: staged.get(g).ok_or_else(|| internal("an entry past the staging".into()))?,
                read: staged.get(r).ok_or_else(|| internal("an entry past the staging".into()))?,
            };
            bufs.check(rule)?;
            crate::fast::apply(rule, &launch.k, n, bufs);
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::Bufs;

    fn values(n: usize, seed: u32, scale: f32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 1000) as f32 / 1000.0 * scale - scale / 2.0)
            .collect()
    }

    /// One chunk's state: parameters, shared planes, per-worker planes.
    #[derive(Debug, Clone, PartialEq)]
    pub(crate) struct ChunkState {
        pub params: Vec<f32>,
        pub shared: Vec<Vec<f32>>,
        pub worker: Vec<Vec<f32>>,
    }

    /// What a scenario ends with: every chunk's state, a pull of chunks 1 and 2, the bytes moved each way.
    pub(crate) struct Outcome {
        pub states: Vec<ChunkState>,
        pub pulled: Vec<f32>,
        pub to_device: u64,
        pub to_host: u64,
    }

    const LENS: [usize; 3] = [300, 17, 1024];
    const WORKERS: u32 = 3;

    pub(crate) fn hyper() -> Hyper {
        Hyper { lr: 0.05, momentum: 0.9, weight_decay: 1e-4, ..Hyper::default() }
    }

    fn initial(rule: Rule) -> Vec<ChunkState> {
        let l = rule.layout();
        let positive = |v: Vec<f32>| v.iter().map(|x| x.abs()).collect::<Vec<f32>>();
        LENS.iter()
            .enumerate()
            .map(|(c, n)| ChunkState {
                params: values(*n, c as u32, 1.0),
                shared: (0..l.shared_planes).map(|k| positive(values(*n, 50 + k as u32, 0.1))).collect(),
                worker: (0..if l.worker_planes > 0 { WORKERS } else { 0 })
                    .map(|w| positive(values(*n, 90 + w, 0.1)))
                    .collect(),
            })
            .collect()
    }

    /// The pushes of a scenario: (chunks, worker slot, scalars, gradients, echoes).
    #[allow(clippy::type_complexity)]
    fn pushes(rule: Rule) -> Vec<(Vec<usize>, u32, Vec<PushScalars>, Vec<Vec<f32>>, Vec<Vec<f32>>)> {
        (0..4u64)
            .map(|step| {
                let chunks = vec![2usize, 0];
                let slot = (step % u64::from(WORKERS)) as u32;
                let scalars = chunks
                    .iter()
                    .map(|c| PushScalars {
                        lr: 0.05,
                        lr_max: 0.08,
                        staleness: step + *c as u64,
                        t: step + 1,
                        workers: WORKERS,
                    })
                    .collect();
                let grads = chunks.iter().map(|c| values(LENS[*c], 7 + step as u32, 2.0)).collect();
                let echo = rule.layout().needs_read;
                let reads =
                    chunks.iter().map(|c| if echo { values(LENS[*c], *c as u32, 1.0) } else { Vec::new() }).collect();
                (chunks, slot, scalars, grads, reads)
            })
            .collect()
    }

    /// Loads the initial state of `rule`'s scenario on `device`, applies its pushes through the resident
    /// executor, and reads everything back.
    pub(crate) fn run_resident<D>(device: D, rule: Rule) -> Outcome
    where
        D: Device + std::fmt::Debug + Send,
        D::Buf: std::fmt::Debug + Send,
    {
        let layout =
            DeviceLayout::new(&LENS.iter().map(|n| (*n as u32, rule)).collect::<Vec<_>>(), WORKERS).expect("layout");
        let mut resident = Resident::new(device, layout).expect("resident");
        for (c, s) in initial(rule).iter().enumerate() {
            let shared: Vec<&[f32]> = s.shared.iter().map(Vec::as_slice).collect();
            let worker: Vec<&[f32]> = s.worker.iter().map(Vec::as_slice).collect();
            resident.load_chunk(c, &s.params, &shared, &worker).expect("load");
        }
        for (chunks, slot, scalars, grads, reads) in pushes(rule) {
            let (grads, reads) = (grads.concat(), reads.concat());
            let hypers = vec![hyper(); chunks.len()];
            let plan = resident
                .push(PushBatch {
                    chunks: &chunks,
                    worker_slot: slot,
                    hypers: &hypers,
                    scalars: &scalars,
                    grads: &grads,
                    reads: &reads,
                })
                .expect("push");
            assert_eq!(plan.bytes_to_device(), 4 * (grads.len() + reads.len()) as u64);
        }
        let states = (0..LENS.len())
            .map(|c| {
                let (params, shared, worker) = resident.read_chunk(c, WORKERS).expect("read");
                ChunkState { params, shared, worker }
            })
            .collect();
        let mut pulled = Vec::new();
        let look = Lookahead { hyper: &hyper(), lr: 0.05, workers: WORKERS };
        resident.pull(&[1, 2], &[look, look], &mut pulled).expect("pull");
        Outcome { states, pulled, to_device: resident.bytes_to_device(), to_host: resident.bytes_to_host() }
    }

    #[test]
    fn the_resident_executor_matches_the_per_chunk_path_for_every_rule() {
        for rule in Rule::ALL {
            let l = rule.layout();
            let got = run_resident(HostDevice, rule);
            // The plain way: one `apply` per chunk on its own host planes.
            let mut plain = initial(rule);
            for (chunks, slot, scalars, grads, reads) in pushes(rule) {
                for (i, c) in chunks.iter().enumerate() {
                    let s = &mut plain[*c];
                    let (s0, s1) = match s.shared.as_mut_slice() {
                        [] => (&mut [][..], &mut [][..]),
                        [a] => (a.as_mut_slice(), &mut [][..]),
                        [a, b, ..] => (a.as_mut_slice(), b.as_mut_slice()),
                    };
                    let w0 = s.worker.get_mut(slot as usize).map_or(&mut [][..], Vec::as_mut_slice);
                    let bufs = Bufs { params: &mut s.params, s0, s1, w0, grad: &grads[i], read: &reads[i] };
                    crate::apply(rule, &hyper(), &scalars[i], bufs).expect("apply");
                }
            }
            // Bit for bit: the same CPU kernels ran on the same values at the arenas' offsets.
            assert_eq!(got.states, plain, "{rule}");
            let mut expected = Vec::new();
            for c in [1, 2] {
                let shared: Vec<f32> = plain[c].shared.concat();
                crate::pull_values(rule, &hyper(), 0.05, WORKERS, &plain[c].params, &shared, &mut expected);
            }
            assert_eq!(got.pulled, expected, "{rule}: the pull reads the parameters or the look-ahead");
            let planes = if l.lookahead { 2 } else { 1 };
            assert_eq!(got.to_host, 4 * planes * (17 + 1024), "{rule}");
            let staged_per_push = (1024 + 300) * if l.needs_read { 2 } else { 1 };
            assert_eq!(got.to_device, 4 * 4 * staged_per_push, "{rule}: only gradients and echoes cross");
        }
    }

    /// A push by worker slot 0.
    fn batch<'a>(
        chunks: &'a [usize],
        hypers: &'a [Hyper],
        scalars: &'a [PushScalars],
        grads: &'a [f32],
        reads: &'a [f32],
    ) -> PushBatch<'a> {
        PushBatch { chunks, worker_slot: 0, hypers, scalars, grads, reads }
    }

    #[test]
    fn pushes_of_the_wrong_shape_are_refused_before_anything_moves() {
        let layout = DeviceLayout::new(&[(8, Rule::Momentum), (4, Rule::GapAware)], 1).expect("layout");
        let mut r = Resident::new(HostDevice, layout).expect("resident");
        let h = Hyper::default();
        let s = PushScalars::fresh(0.1, 1);
        assert!(r.push(batch(&[0], &[h], &[s], &[0.0; 7], &[])).is_err(), "too few floats");
        assert!(r.push(batch(&[1], &[h], &[s], &[0.0; 4], &[])).is_err(), "gap-aware without its echo");
        assert!(r.push(batch(&[1], &[h], &[s], &[0.0; 8], &[])).is_err(), "the echo counted as gradient");
        assert!(r.push(batch(&[0, 1], &[h, h], &[s], &[0.0; 12], &[0.0; 4])).is_err(), "one set of scalars for two");
        assert!(r.push(batch(&[0, 1], &[h], &[s, s], &[0.0; 12], &[0.0; 4])).is_err(), "one hyper for two chunks");
        assert!(r.push(batch(&[2], &[h], &[s], &[0.0; 8], &[])).is_err(), "no such chunk");
        assert!(r.load_chunk(0, &[0.0; 8], &[], &[]).is_err(), "momentum's plane missing");
        assert_eq!(r.bytes_to_device(), 0);
        r.push(batch(&[1, 0], &[h, h], &[s, s], &[0.0; 12], &[0.0; 4])).expect("a push of the right shape");
        assert_eq!(r.bytes_to_device(), 64);
        // Parameters alone can be replaced and read back; the optimizer state stays.
        assert!(r.load_params(1, &[1.0; 3]).is_err(), "wrong length");
        r.load_params(1, &[1.0, 2.0, 3.0, 4.0]).expect("load");
        let mut out = vec![9.0];
        r.read_params(1, &mut out).expect("read");
        assert_eq!(out, [9.0, 1.0, 2.0, 3.0, 4.0]);
        assert_eq!(r.read_chunk(1, 1).expect("read").1.len(), 2, "gap-aware keeps two shared planes");
    }

    /// One pull of chunks with and without a look-ahead, each with its own learning rate, in an order
    /// that is not the layout's and with a chunk named twice, reads what a pull of each chunk alone reads;
    /// a pull with a look-ahead too few is refused.
    #[test]
    fn a_pull_of_mixed_chunks_reads_each_as_its_own_pull_does() {
        let rules = [(5, Rule::DanaZero), (8, Rule::Sgd), (3, Rule::DelayNesterov), (6, Rule::Momentum)];
        let layout = DeviceLayout::new(&rules, 2).expect("layout");
        let mut r = Resident::new(HostDevice, layout).expect("resident");
        for (c, (len, rule)) in rules.iter().enumerate() {
            let len = *len as usize;
            let params = crate::tests::random(len, c as u64 + 1, -1.0, 1.0);
            let shared: Vec<Vec<f32>> = (0..rule.layout().shared_planes)
                .map(|k| crate::tests::random(len, 10 * c as u64 + k as u64, -1.0, 1.0))
                .collect();
            let shared: Vec<&[f32]> = shared.iter().map(Vec::as_slice).collect();
            r.load_chunk(c, &params, &shared, &[]).expect("load");
        }
        let h = hyper();
        let chunks = [2, 1, 0, 3, 0];
        let looks: Vec<Lookahead<'_>> =
            chunks.iter().map(|&c| Lookahead { hyper: &h, lr: 0.01 * (c + 1) as f32, workers: 3 }).collect();
        let mut together = vec![7.0];
        r.pull(&chunks, &looks, &mut together).expect("pull");
        let mut alone = vec![7.0];
        for (&c, look) in chunks.iter().zip(&looks) {
            r.pull(&[c], std::slice::from_ref(look), &mut alone).expect("pull one");
        }
        assert_eq!(together, alone);
        assert_eq!(together.len(), 1 + 3 + 8 + 5 + 6 + 5);
        let plain: Vec<f32> = {
            let mut v = Vec::new();
            r.read_params(2, &mut v).expect("read");
            v
        };
        assert_ne!(&together[1..4], &plain[..], "delay-nesterov's chunk reads its look-ahead");
        assert!(r.pull(&chunks, &looks[..4], &mut Vec::new()).is_err(), "a look-ahead too few");
    }
}
