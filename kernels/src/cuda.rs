//! The update rules on an NVIDIA GPU: `cuda/rules.cu`, compiled at run time by NVRTC through cudarc with
//! dynamic loading, so the project builds and tests on machines without CUDA. The driver and NVRTC libraries
//! are probed before any CUDA call (cudarc panics on first use when they are absent); `--device cuda` then
//! fails with a clear message and `--device auto` falls back to the CPU.

use crate::{derive, Bufs, Hyper, KernelError, PushScalars, Rule};
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};
use std::sync::Arc;

/// The kernel source, compiled at run time.
pub const SOURCE: &str = include_str!("../cuda/rules.cu");

/// Where updates run, as chosen by `--device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The fast CPU path.
    Cpu,
    /// The GPU; an error when none can be used.
    Cuda,
    /// The GPU when one can be used, else the CPU.
    Auto,
}

gaps_common::named_variants!(DeviceChoice, "device", KernelError, KernelError::BadHyper, {
    Cpu => "cpu",
    Cuda => "cuda",
    Auto => "auto",
});

impl DeviceChoice {
    /// `auto` becomes `cuda` when the environment sets `GAPS_REQUIRE_GPU=1` (as `scripts/gpu-check` does),
    /// so a check meant for a GPU fails with the reason instead of quietly running on the CPU.
    pub fn honouring_require_gpu(self) -> Self {
        match (self, std::env::var("GAPS_REQUIRE_GPU").as_deref()) {
            (DeviceChoice::Auto, Ok("1")) => DeviceChoice::Cuda,
            (choice, _) => choice,
        }
    }
}

/// Why no GPU can be used, or a CUDA call that failed.
fn cuda_err(what: &str, e: impl std::fmt::Display) -> KernelError {
    KernelError::Device(format!("{what}: {e}"))
}

/// Checks that the CUDA driver and NVRTC libraries can be loaded, without touching them otherwise.
pub fn probe() -> Result<(), KernelError> {
    #[allow(unsafe_code)]
    // SAFETY: both probes only try to dlopen the libraries by name and drop the handle; no CUDA call is made.
    let (driver, nvrtc) = unsafe { (cudarc::driver::sys::is_culib_present(), cudarc::nvrtc::sys::is_culib_present()) };
    match (driver, nvrtc) {
        (true, true) => Ok(()),
        (false, _) => Err(KernelError::Device("no CUDA driver library (libcuda) on this machine".into())),
        (true, false) => Err(KernelError::Device("the CUDA driver is present but NVRTC (libnvrtc) is not".into())),
    }
}

/// Compiles `rules.cu` to PTX with NVRTC. Needs only libnvrtc, no GPU and no driver: `.ci/run` runs it
/// (`rules_cu_compiles_with_nvrtc`) with the `nvidia-cuda-nvrtc-cu12` wheel's library, so a kernel that does
/// not compile fails CI on machines without a GPU.
pub fn compile_rules() -> Result<cudarc::nvrtc::Ptx, KernelError> {
    #[allow(unsafe_code)]
    // SAFETY: only tries to dlopen the library by name and drops the handle; no NVRTC call is made.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(KernelError::Device("NVRTC (libnvrtc) is not on this machine".into()));
    }
    let opts = cudarc::nvrtc::CompileOptions { fmad: Some(false), ..Default::default() };
    cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts).map_err(|e| cuda_err("compiling rules.cu with NVRTC", e))
}

/// The per-push scalars as the kernel receives them (layout of `struct Scalars` in `rules.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct KernelScalars {
    lr: f32,
    lr_max: f32,
    gamma: f32,
    wd: f32,
    lambda: f32,
    ms_decay: f32,
    inv_staleness: f32,
    ga_bias: f32,
    adam_bias1: f32,
    adam_bias2: f32,
    nag_gamma: f32,
    nag_keep: f32,
    nag_lr: f32,
    nadam_grad: f32,
    nadam_mom: f32,
    decay: f32,
}

#[allow(unsafe_code)]
// SAFETY: a #[repr(C)] struct of sixteen f32, matching the kernel's `struct Scalars` field for field.
unsafe impl DeviceRepr for KernelScalars {}

fn rule_id(rule: Rule) -> i32 {
    Rule::ALL.iter().position(|r| *r == rule).unwrap_or(0) as i32
}

/// A GPU with the update kernel loaded.
#[derive(Debug)]
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    update: CudaFunction,
    name: String,
}

/// One block of parameters resident on the GPU (planes the rule does not use hold one unused float).
#[derive(Debug)]
pub struct DeviceBlock {
    n: usize,
    params: CudaSlice<f32>,
    s0: CudaSlice<f32>,
    s1: CudaSlice<f32>,
    w0: CudaSlice<f32>,
    grad: CudaSlice<f32>,
    read: CudaSlice<f32>,
}

impl CudaDevice {
    /// Opens GPU `ordinal` and compiles the kernels, after probing for the libraries.
    pub fn open(ordinal: usize) -> Result<Self, KernelError> {
        probe()?;
        let count = CudaContext::device_count().map_err(|e| cuda_err("counting GPUs", e))?;
        if ordinal as i64 >= i64::from(count) {
            return Err(KernelError::Device(format!("GPU {ordinal} requested, {count} present")));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda_err("opening the GPU", e))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let ptx = compile_rules()?;
        let module = ctx.load_module(ptx).map_err(|e| cuda_err("loading the compiled kernels", e))?;
        let update = module.load_function("gaps_update").map_err(|e| cuda_err("finding gaps_update", e))?;
        let stream = ctx.default_stream();
        Ok(CudaDevice { ctx, stream, update, name })
    }

    /// Opens a GPU as `choice` asks: `Ok(None)` means "use the CPU".
    pub fn for_choice(choice: DeviceChoice) -> Result<Option<Self>, KernelError> {
        match choice.honouring_require_gpu() {
            DeviceChoice::Cpu => Ok(None),
            DeviceChoice::Cuda => CudaDevice::open(0).map(Some),
            DeviceChoice::Auto => Ok(CudaDevice::open(0).ok()),
        }
    }

    /// The GPU's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Copies a host block to the GPU.
    pub fn upload(&self, rule: Rule, bufs: &Bufs<'_>) -> Result<DeviceBlock, KernelError> {
        bufs.check(rule)?;
        let up = |host: &[f32]| {
            let data: &[f32] = if host.is_empty() { &[0.0] } else { host };
            self.stream.clone_htod(data).map_err(|e| cuda_err("copying to the GPU", e))
        };
        Ok(DeviceBlock {
            n: bufs.params.len(),
            params: up(bufs.params)?,
            s0: up(bufs.s0)?,
            s1: up(bufs.s1)?,
            w0: up(bufs.w0)?,
            grad: up(bufs.grad)?,
            read: up(bufs.read)?,
        })
    }

    /// Copies a block's parameters and state planes back into the host buffers.
    pub fn download(&self, block: &DeviceBlock, bufs: &mut Bufs<'_>) -> Result<(), KernelError> {
        let down = |dev: &CudaSlice<f32>, host: &mut [f32]| {
            if host.is_empty() {
                return Ok(());
            }
            let view = dev.slice(0..host.len());
            self.stream.memcpy_dtoh(&view, host).map_err(|e| cuda_err("copying from the GPU", e))
        };
        down(&block.params, bufs.params)?;
        down(&block.s0, bufs.s0)?;
        down(&block.s1, bufs.s1)?;
        down(&block.w0, bufs.w0)?;
        self.stream.synchronize().map_err(|e| cuda_err("waiting for the GPU", e))
    }

    /// Launches the update on a resident block (asynchronous; [`CudaDevice::synchronize`] waits).
    pub fn apply_resident(
        &self,
        rule: Rule,
        hyper: &Hyper,
        scalars: &PushScalars,
        block: &mut DeviceBlock,
    ) -> Result<(), KernelError> {
        let ks = KernelScalars::from(&derive(rule, hyper, scalars));
        let id = rule_id(rule);
        let n = block.n as u64;
        // Enough blocks to fill the GPU several times over; the kernel strides over the rest.
        let blocks = (block.n.div_ceil(256)).clamp(1, 65_535) as u32;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut launch = self.stream.launch_builder(&self.update);
        launch
            .arg(&id)
            .arg(&n)
            .arg(&mut block.params)
            .arg(&mut block.s0)
            .arg(&mut block.s1)
            .arg(&mut block.w0)
            .arg(&block.grad)
            .arg(&block.read)
            .arg(&ks);
        #[allow(unsafe_code)]
        // SAFETY: the arguments match `gaps_update`'s signature in rules.cu in order and type; every plane the
        // rule touches holds `n` floats (checked by `upload`), and the kernel never indexes past `n`.
        unsafe { launch.launch(cfg) }.map_err(|e| cuda_err("launching gaps_update", e))?;
        Ok(())
    }

    /// Waits for all queued GPU work.
    pub fn synchronize(&self) -> Result<(), KernelError> {
        self.stream.synchronize().map_err(|e| cuda_err("waiting for the GPU", e))
    }

    /// Applies `rule` to a host block on the GPU: upload, one launch, download.
    pub fn apply(
        &self,
        rule: Rule,
        hyper: &Hyper,
        scalars: &PushScalars,
        mut bufs: Bufs<'_>,
    ) -> Result<(), KernelError> {
        let mut block = self.upload(rule, &bufs)?;
        self.apply_resident(rule, hyper, scalars, &mut block)?;
        self.download(&block, &mut bufs)
    }

    /// Device-to-device copy bandwidth in bytes moved per second (read + write), over `bytes` bytes copied
    /// `reps` times, timed with CUDA events.
    pub fn copy_bandwidth(&self, bytes: usize, reps: u32) -> Result<f64, KernelError> {
        let n = (bytes / 4).max(1);
        let src = self.stream.alloc_zeros::<f32>(n).map_err(|e| cuda_err("allocating", e))?;
        let mut dst = self.stream.alloc_zeros::<f32>(n).map_err(|e| cuda_err("allocating", e))?;
        self.stream.memcpy_dtod(&src, &mut dst).map_err(|e| cuda_err("copying", e))?;
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.ctx.new_event(timing).map_err(|e| cuda_err("creating an event", e))?;
        let end = self.ctx.new_event(timing).map_err(|e| cuda_err("creating an event", e))?;
        start.record(&self.stream).map_err(|e| cuda_err("recording", e))?;
        for _ in 0..reps {
            self.stream.memcpy_dtod(&src, &mut dst).map_err(|e| cuda_err("copying", e))?;
        }
        end.record(&self.stream).map_err(|e| cuda_err("recording", e))?;
        let ms = start.elapsed_ms(&end).map_err(|e| cuda_err("timing", e))?;
        Ok(2.0 * (n * 4) as f64 * f64::from(reps) / (f64::from(ms.max(1e-6)) / 1e3))
    }

    /// Seconds per update of a resident block, averaged over `reps` launches timed with CUDA events.
    pub fn time_update(
        &self,
        rule: Rule,
        hyper: &Hyper,
        block: &mut DeviceBlock,
        reps: u32,
    ) -> Result<f64, KernelError> {
        let s = PushScalars { lr: hyper.lr, lr_max: hyper.lr, staleness: 3, t: 1, workers: 8 };
        self.apply_resident(rule, hyper, &s, block)?;
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.ctx.new_event(timing).map_err(|e| cuda_err("creating an event", e))?;
        let end = self.ctx.new_event(timing).map_err(|e| cuda_err("creating an event", e))?;
        start.record(&self.stream).map_err(|e| cuda_err("recording", e))?;
        for t in 0..reps {
            let s = PushScalars { t: u64::from(t) + 2, ..s };
            self.apply_resident(rule, hyper, &s, block)?;
        }
        end.record(&self.stream).map_err(|e| cuda_err("recording", e))?;
        let ms = start.elapsed_ms(&end).map_err(|e| cuda_err("timing", e))?;
        Ok(f64::from(ms) / 1e3 / f64::from(reps.max(1)))
    }
}

impl From<&crate::Derived> for KernelScalars {
    fn from(k: &crate::Derived) -> Self {
        KernelScalars {
            lr: k.lr,
            lr_max: k.lr_max,
            gamma: k.gamma,
            wd: k.wd,
            lambda: k.lambda,
            ms_decay: k.ms_decay,
            inv_staleness: k.inv_staleness,
            ga_bias: k.ga_bias,
            adam_bias1: k.adam_bias1,
            adam_bias2: k.adam_bias2,
            nag_gamma: k.nag_gamma,
            nag_keep: k.nag_keep,
            nag_lr: k.nag_lr,
            nadam_grad: k.nadam_grad,
            nadam_mom: k.nadam_mom,
            decay: k.decay,
        }
    }
}

/// One chunk-table entry as `rules.cu`'s `struct TableEntry` lays it out: four offsets, the length, the
/// rule, the scalars (104 bytes: 8-byte aligned without padding).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DeviceEntry {
    param_offset: u64,
    worker_offset: u64,
    grad_offset: u64,
    read_offset: u64,
    len: u32,
    rule: i32,
    k: KernelScalars,
}

#[allow(unsafe_code)]
// SAFETY: a #[repr(C)] struct of u64, u32, i32 and f32 fields matching `struct TableEntry` in rules.cu.
unsafe impl DeviceRepr for DeviceEntry {}

/// A GPU as a [`crate::resident::Device`]: arenas in device memory, pushes staged through one pinned
/// (write-combined) host buffer and applied by `gaps_update_table`, one launch per 65,535 table entries;
/// pulls come back through a plain page-locked buffer, every chunk queued and waited for once.
/// Built and NVRTC-compiled in CI; it has run only where a GPU was lent (see docs/results.md, Update kernels).
#[derive(Debug)]
pub struct CudaArenas {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    table_fn: CudaFunction,
    name: String,
    /// The staging buffer on the host, allocated by `reserve` (the largest push).
    pinned: Option<cudarc::driver::PinnedHostSlice<f32>>,
    /// The chunk table on the device, allocated by `reserve` (one entry per chunk).
    table: Option<CudaSlice<DeviceEntry>>,
    /// Recorded after the last transfer out of `pinned`. A copy from page-locked memory is a DMA that runs
    /// after `memcpy_htod` returns (cudarc records nothing for a plain slice), so the buffer must not be
    /// written again until this event has passed: writing it earlier corrupted the transfer in flight.
    pinned_busy: Option<cudarc::driver::CudaEvent>,
    /// Page-locked memory that pulls come back through (plain, not write-combined: the CPU reads it), at
    /// most [`PULL_PIECE`] floats, allocated by the first large pull.
    pulled: std::sync::Mutex<Option<cudarc::driver::PinnedHostSlice<f32>>>,
}

mod pieces;
use pieces::{copy_in_parts, pull_pieces};

/// The most floats a pull brings back through page-locked memory at a time (64 MiB); a larger pull goes in
/// pieces of this size.
const PULL_PIECE: usize = 16 << 20;
/// A pull smaller than this many floats (256 KiB) is copied chunk by chunk straight into its destination.
const PULL_PINNED_MIN: usize = 64 << 10;

impl CudaArenas {
    /// Opens GPU `ordinal` and compiles the kernels, after probing for the libraries.
    pub fn open(ordinal: usize) -> Result<Self, KernelError> {
        let gpu = CudaDevice::open(ordinal)?;
        let ptx = compile_rules()?;
        let module = gpu.ctx.load_module(ptx).map_err(|e| cuda_err("loading the compiled kernels", e))?;
        let table_fn =
            module.load_function("gaps_update_table").map_err(|e| cuda_err("finding gaps_update_table", e))?;
        Ok(CudaArenas {
            ctx: gpu.ctx,
            stream: gpu.stream,
            table_fn,
            name: gpu.name,
            pinned: None,
            table: None,
            pinned_busy: None,
            pulled: std::sync::Mutex::new(None),
        })
    }

    /// Opens a GPU as `choice` asks: `Ok(None)` means "keep the state on the host".
    pub fn for_choice(choice: DeviceChoice) -> Result<Option<Self>, KernelError> {
        match choice.honouring_require_gpu() {
            DeviceChoice::Cpu => Ok(None),
            DeviceChoice::Cuda => CudaArenas::open(0).map(Some),
            DeviceChoice::Auto => Ok(CudaArenas::open(0).ok()),
        }
    }
}

impl CudaArenas {
    /// Waits until the transfer that last read the pinned staging buffer has finished, so it can be written.
    fn wait_pinned_free(&mut self) -> Result<(), KernelError> {
        match self.pinned_busy.take() {
            Some(event) => event.synchronize().map_err(|e| cuda_err("waiting for the staging buffer", e)),
            None => Ok(()),
        }
    }

    /// Marks the pinned staging buffer busy until the transfers queued so far on the stream have run.
    fn mark_pinned_busy(&mut self) -> Result<(), KernelError> {
        let event = self.stream.record_event(None).map_err(|e| cuda_err("recording a staging event", e))?;
        self.pinned_busy = Some(event);
        Ok(())
    }

    /// The bound of a server-path round: bytes per second when `bytes` (half to the device, half back, as
    /// a push and a pull move them) are copied between page-locked host memory and the device, timed with
    /// CUDA events over `reps` rounds.
    pub fn pinned_copy_bandwidth(&self, bytes: usize, reps: u32) -> Result<f64, KernelError> {
        let n = (bytes / 8).max(1);
        #[allow(unsafe_code)]
        // SAFETY: the pinned buffers' contents are unset; they are only copied, never interpreted.
        let (up, mut down) = unsafe {
            (
                self.ctx.alloc_pinned::<f32>(n).map_err(|e| cuda_err("pinning host memory", e))?,
                self.ctx.alloc_pinned::<f32>(n).map_err(|e| cuda_err("pinning host memory", e))?,
            )
        };
        let mut dev = self.stream.alloc_zeros::<f32>(n).map_err(|e| cuda_err("allocating", e))?;
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.ctx.new_event(timing).map_err(|e| cuda_err("creating an event", e))?;
        let end = self.ctx.new_event(timing).map_err(|e| cuda_err("creating an event", e))?;
        start.record(&self.stream).map_err(|e| cuda_err("recording", e))?;
        for _ in 0..reps.max(1) {
            self.stream.memcpy_htod(&up, &mut dev).map_err(|e| cuda_err("copying to the GPU", e))?;
            self.stream.memcpy_dtoh(&dev, &mut down).map_err(|e| cuda_err("copying from the GPU", e))?;
        }
        end.record(&self.stream).map_err(|e| cuda_err("recording", e))?;
        let ms = start.elapsed_ms(&end).map_err(|e| cuda_err("timing", e))?;
        Ok((8 * n) as f64 * f64::from(reps.max(1)) / (f64::from(ms) / 1e3).max(1e-12))
    }
}

impl crate::resident::Device for CudaArenas {
    type Buf = CudaSlice<f32>;

    fn name(&self) -> String {
        self.name.clone()
    }

    fn reserve(&mut self, staging_floats: u64, table_entries: usize) -> Result<(), KernelError> {
        let n = usize::try_from(staging_floats).map_err(|_| KernelError::Device("staging too large".into()))?;
        // The old buffer may still feed a transfer: it is freed only once that has run.
        self.wait_pinned_free()?;
        #[allow(unsafe_code)]
        // SAFETY: the pinned buffer's contents are unset until a push writes them; only written before read.
        let pinned =
            unsafe { self.ctx.alloc_pinned::<f32>(n.max(1)) }.map_err(|e| cuda_err("pinning host memory", e))?;
        self.pinned = Some(pinned);
        let zero = DeviceEntry {
            param_offset: 0,
            worker_offset: 0,
            grad_offset: 0,
            read_offset: 0,
            len: 0,
            rule: 0,
            k: KernelScalars::from(&crate::derive(Rule::Sgd, &Hyper::default(), &PushScalars::fresh(0.0, 1))),
        };
        let table = self
            .stream
            .clone_htod(&vec![zero; table_entries.max(1)])
            .map_err(|e| cuda_err("allocating the chunk table", e))?;
        self.table = Some(table);
        Ok(())
    }

    fn alloc_zeroed(&mut self, floats: u64) -> Result<CudaSlice<f32>, KernelError> {
        let n = usize::try_from(floats).map_err(|_| KernelError::Device(format!("{floats} floats")))?;
        self.stream.alloc_zeros::<f32>(n).map_err(|e| cuda_err("allocating device memory", e))
    }

    fn upload(&mut self, src: &[f32], dst: &mut CudaSlice<f32>, offset: u64) -> Result<(), KernelError> {
        let at = offset as usize;
        if at + src.len() > dst.len() {
            return Err(KernelError::Internal("an upload past its device buffer".into()));
        }
        let mut view = dst.slice_mut(at..at + src.len());
        if self.pinned.as_ref().is_none_or(|pinned| src.len() > pinned.len()) {
            // From pageable memory the driver copies `src` into its own buffer before returning.
            return self.stream.memcpy_htod(src, &mut view).map_err(|e| cuda_err("copying to the GPU", e));
        }
        self.wait_pinned_free()?;
        let pinned = self.pinned.as_mut().ok_or_else(|| KernelError::Internal("no staging buffer reserved".into()))?;
        let host = pinned.as_mut_slice().map_err(|e| cuda_err("waiting for the staging buffer", e))?;
        copy_in_parts(&mut host[..src.len()], src);
        // From page-locked memory: a DMA transfer, no bounce through a driver buffer; it reads `host` after
        // this call returns, so the buffer is marked busy until it has.
        self.stream.memcpy_htod(&host[..src.len()], &mut view).map_err(|e| cuda_err("copying to the GPU", e))?;
        self.mark_pinned_busy()
    }

    fn stage(&mut self, parts: &[&[f32]], staging: &mut CudaSlice<f32>) -> Result<(), KernelError> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        if total > staging.len() {
            return Err(KernelError::Internal("a push larger than its staging buffer".into()));
        }
        if total > self.pinned.as_ref().map_or(0, |pinned| pinned.len()) {
            return Err(KernelError::Internal("a push larger than the pinned buffer".into()));
        }
        // Waits for the previous transfer out of the buffer before writing it again.
        self.wait_pinned_free()?;
        let pinned = self.pinned.as_mut().ok_or_else(|| KernelError::Internal("no staging buffer reserved".into()))?;
        let host = pinned.as_mut_slice().map_err(|e| cuda_err("waiting for the staging buffer", e))?;
        let mut at = 0;
        for part in parts {
            copy_in_parts(&mut host[at..at + part.len()], part);
            at += part.len();
        }
        if total == 0 {
            return Ok(());
        }
        // Gradients and echoes in one DMA transfer from page-locked memory.
        let mut view = staging.slice_mut(0..total);
        self.stream.memcpy_htod(&host[..total], &mut view).map_err(|e| cuda_err("copying the push to the GPU", e))?;
        self.mark_pinned_busy()
    }

    fn download(&self, src: &CudaSlice<f32>, offset: u64, dst: &mut [f32]) -> Result<(), KernelError> {
        let at = offset as usize;
        if at + dst.len() > src.len() {
            return Err(KernelError::Internal("a download past its device buffer".into()));
        }
        let view = src.slice(at..at + dst.len());
        self.stream.memcpy_dtoh(&view, dst).map_err(|e| cuda_err("copying from the GPU", e))?;
        self.stream.synchronize().map_err(|e| cuda_err("waiting for the GPU", e))
    }

    fn download_many(&self, src: &CudaSlice<f32>, copies: &[(u64, usize)], dst: &mut [f32]) -> Result<(), KernelError> {
        let total: usize = copies.iter().map(|(_, len)| len).sum();
        if total < PULL_PINNED_MIN {
            return crate::resident::download_each(self, src, copies, dst);
        }
        if total != dst.len() {
            return Err(KernelError::Internal(format!("{total} floats to download into {}", dst.len())));
        }
        if copies.iter().any(|&(offset, len)| (offset as usize).checked_add(len).is_none_or(|end| end > src.len())) {
            return Err(KernelError::Internal("a download past its device buffer".into()));
        }
        let pieces = pull_pieces(copies, PULL_PIECE);
        let mut pulled = self.pulled.lock().map_err(|_| KernelError::Internal("the pull buffer's lock".into()))?;
        let piece = total.min(PULL_PIECE);
        if pulled.as_ref().is_none_or(|p| p.len() < piece) {
            // A copy queued by a pull that failed half-way may still be writing the old buffer.
            self.stream.synchronize().map_err(|e| cuda_err("waiting for the GPU", e))?;
            *pulled = None;
            #[allow(unsafe_code)]
            // SAFETY: the buffer's contents are unset until the zeros written next.
            let mut fresh = unsafe { self.ctx.alloc_pinned_with_flags::<f32>(piece, 0) }
                .map_err(|e| cuda_err("pinning host memory", e))?;
            fresh.as_mut_slice().map_err(|e| cuda_err("waiting for the pull buffer", e))?.fill(0.0);
            *pulled = Some(fresh);
        }
        let host = pulled
            .as_mut()
            .ok_or_else(|| KernelError::Internal("no pull buffer".into()))?
            .as_mut_slice()
            .map_err(|e| cuda_err("waiting for the pull buffer", e))?;
        // Every copy of a piece queued, one wait, then one copy out.
        let mut done = 0;
        for piece in pieces {
            let mut filled = 0;
            for (offset, len) in piece {
                let view = src.slice(offset..offset + len);
                self.stream
                    .memcpy_dtoh(&view, &mut host[filled..filled + len])
                    .map_err(|e| cuda_err("copying from the GPU", e))?;
                filled += len;
            }
            self.stream.synchronize().map_err(|e| cuda_err("waiting for the GPU", e))?;
            copy_in_parts(&mut dst[done..done + filled], &host[..filled]);
            done += filled;
        }
        Ok(())
    }

    fn apply_table(
        &mut self,
        table: &[crate::resident::Launch],
        arenas: &mut crate::resident::Arenas<CudaSlice<f32>>,
        staged: &CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let entries: Vec<DeviceEntry> = table
            .iter()
            .map(|l| DeviceEntry {
                param_offset: l.entry.param_offset,
                worker_offset: l.entry.worker_offset,
                grad_offset: l.entry.grad_offset,
                read_offset: l.entry.read_offset,
                len: l.entry.len,
                rule: l.entry.rule,
                k: KernelScalars::from(&l.k),
            })
            .collect();
        let device_table =
            self.table.as_mut().ok_or_else(|| KernelError::Internal("no chunk table reserved".into()))?;
        if entries.is_empty() {
            return Ok(());
        }
        if entries.len() > device_table.len() {
            return Err(KernelError::Internal("more table entries than chunks".into()));
        }
        let mut view = device_table.slice_mut(0..entries.len());
        self.stream.memcpy_htod(&entries[..], &mut view).map_err(|e| cuda_err("copying the chunk table", e))?;
        for (group, chunk) in entries.chunks(crate::plan::MAX_ENTRIES_PER_LAUNCH).enumerate() {
            let longest = chunk.iter().map(|e| e.len).max().unwrap_or(1);
            // Enough blocks per entry for its length (the kernel strides over the rest), at most 1,024.
            let blocks_x = longest.div_ceil(256).clamp(1, 1024);
            let cfg = LaunchConfig {
                grid_dim: (blocks_x, chunk.len() as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let first = (group * crate::plan::MAX_ENTRIES_PER_LAUNCH) as u32;
            let mut launch = self.stream.launch_builder(&self.table_fn);
            launch
                .arg(&*device_table)
                .arg(&first)
                .arg(&mut arenas.params)
                .arg(&mut arenas.s0)
                .arg(&mut arenas.s1)
                .arg(&mut arenas.worker)
                .arg(staged);
            #[allow(unsafe_code)]
            // SAFETY: the arguments match `gaps_update_table` in rules.cu in order and type; every entry's
            // offsets come from the layout's plan, which keeps each chunk inside its arenas and the staged
            // push, and the arenas were sized by that layout (`Resident::new`).
            unsafe { launch.launch(cfg) }.map_err(|e| cuda_err("launching gaps_update_table", e))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::{self, State};
    use crate::tests::random;

    #[test]
    fn device_choice_parses_and_missing_gpu_is_a_clear_error() {
        assert_eq!("auto".parse::<DeviceChoice>().expect("parse"), DeviceChoice::Auto);
        assert!("tpu".parse::<DeviceChoice>().is_err());
        if let Err(e) = probe() {
            // No GPU here: `cuda` must fail with the probe's message and `auto` must fall back to the CPU.
            let err = CudaDevice::for_choice(DeviceChoice::Cuda).expect_err("no GPU");
            assert_eq!(err.to_string(), e.to_string());
            assert!(CudaDevice::for_choice(DeviceChoice::Auto).expect("auto").is_none());
        }
    }

    #[test]
    fn the_chunk_table_entry_has_the_layout_rules_cu_reads() {
        // struct TableEntry { u64 ×4; u32 len; int rule; Scalars k (16 floats) }: 104 bytes, already a multiple of the
        // 8-byte alignment of its first fields.
        assert_eq!(std::mem::size_of::<KernelScalars>(), 64);
        assert_eq!(std::mem::size_of::<DeviceEntry>(), 104);
        assert_eq!(std::mem::align_of::<DeviceEntry>(), 8);
        assert_eq!(std::mem::offset_of!(DeviceEntry, len), 32);
        assert_eq!(std::mem::offset_of!(DeviceEntry, rule), 36);
        assert_eq!(std::mem::offset_of!(DeviceEntry, k), 40);
    }

    /// NVRTC compiles every rule's kernel (no GPU needed). `.ci/run` installs libnvrtc from PyPI and runs
    /// this; it fails, rather than passing, when libnvrtc cannot be loaded.
    #[test]
    #[ignore = "needs libnvrtc: .ci/run provides it (the nvidia-cuda-nvrtc-cu12 wheel) and runs this"]
    fn rules_cu_compiles_with_nvrtc() {
        let ptx = compile_rules().unwrap_or_else(|e| panic!("NVRTC is missing or rules.cu does not compile: {e}"));
        let text = ptx.to_src();
        for entry in [".entry gaps_update(", ".entry gaps_update_table("] {
            assert!(text.contains(entry), "no {entry} in the PTX:\n{text:.2000}");
        }
        // The rules' square roots and divisions compile to the IEEE-rounded forms (no fast-math).
        for op in ["sqrt.rn.f32", "div.rn.f32"] {
            assert!(text.contains(op), "no {op} in the PTX:\n{text:.2000}");
        }
    }

    /// The device-resident executor on a GPU ends where the host executor ends, for every rule, moving the
    /// same bytes. Needs an NVIDIA GPU; fails, rather than passing, when none can be opened.
    #[test]
    #[ignore = "needs an NVIDIA GPU (cargo test -p gaps-kernels -- --ignored)"]
    fn resident_gpu_state_matches_the_host_executor_for_every_rule() {
        use crate::resident::tests::run_resident;
        use crate::resident::HostDevice;
        for rule in Rule::ALL {
            let gpu = CudaArenas::open(0).unwrap_or_else(|e| panic!("this test needs a GPU: {e}"));
            let (dev, host) = (run_resident(gpu, rule), run_resident(HostDevice, rule));
            assert_eq!((dev.to_device, dev.to_host), (host.to_device, host.to_host), "{rule}: bytes moved");
            let close = |a: &[f32], b: &[f32], what: &str| {
                assert_eq!(a.len(), b.len(), "{rule} {what}");
                for (i, (x, y)) in a.iter().zip(b).enumerate() {
                    assert!((x - y).abs() <= 1e-5 * y.abs().max(1e-3), "{rule} {what}[{i}]: gpu {x} vs host {y}");
                }
            };
            for (c, (d, h)) in dev.states.iter().zip(&host.states).enumerate() {
                close(&d.params, &h.params, &format!("chunk {c} params"));
                close(&d.shared.concat(), &h.shared.concat(), &format!("chunk {c} shared"));
                close(&d.worker.concat(), &h.worker.concat(), &format!("chunk {c} worker"));
            }
            close(&dev.pulled, &host.pulled, "pull");
        }
    }

    /// Needs an NVIDIA GPU: run with `cargo test -p gaps-kernels -- --ignored` where one is present. It
    /// fails, rather than passing, when no GPU can be opened.
    #[test]
    #[ignore = "needs an NVIDIA GPU (cargo test -p gaps-kernels -- --ignored)"]
    fn gpu_matches_the_reference_for_every_rule() {
        let device = CudaDevice::open(0).unwrap_or_else(|e| panic!("this test needs a GPU: {e}"));
        let n = 100_003;
        let h = Hyper { lr: 0.05, momentum: 0.9, weight_decay: 1e-3, dc_lambda: 2.0, dc_ms_decay: 0.95 };
        for (r, rule) in Rule::ALL.into_iter().enumerate() {
            let l = rule.layout();
            let mut shared = random(l.shared_planes * n, 3 * r as u64 + 1, 0.0, 0.5);
            // The first shared plane is a signed velocity for most rules, but Adagrad's is a sum of squares:
            // a negative one would make both sides NaN, which no comparison can check.
            if rule != Rule::Adagrad {
                shared.iter_mut().take(n).for_each(|x| *x -= 0.25);
            }
            let worker = random(l.worker_planes * n, 3 * r as u64 + 2, 0.0, 0.5);
            let mut gpu = State { params: random(n, 3 * r as u64, -1.0, 1.0), shared, worker };
            let mut cpu = gpu.clone();
            for step in 0..3u64 {
                let grad = random(n, 100 + step, -1.0, 1.0);
                let read: Vec<f32> =
                    cpu.params.iter().zip(random(n, 200 + step, -0.01, 0.01)).map(|(p, d)| p + d).collect();
                let read_used: &[f32] = if l.needs_read { &read } else { &[] };
                let s = PushScalars { lr: 0.05, lr_max: 0.08, staleness: step + 2, t: step + 1, workers: 4 };
                let bufs = Bufs::from_planes(&mut gpu.params, &mut gpu.shared, &mut gpu.worker, &grad, read_used);
                device.apply(rule, &h, &s, bufs).expect("gpu apply");
                reference::apply(rule, &h, &s, &mut cpu, &grad, &read);
            }
            for (what, a, b) in [
                ("params", &gpu.params, &cpu.params),
                ("shared", &gpu.shared, &cpu.shared),
                ("worker", &gpu.worker, &cpu.worker),
            ] {
                for (i, (x, y)) in a.iter().zip(b.iter()).enumerate() {
                    assert!(y.is_finite(), "{rule} {what}[{i}]: the reference is {y}; the test's inputs are invalid");
                    assert!((x - y).abs() <= 1e-5 * y.abs().max(1e-3), "{rule} {what}[{i}]: gpu {x} vs reference {y}");
                }
            }
        }
        eprintln!("GPU {} matches the reference for all {} rules", device.name(), Rule::ALL.len());
    }
}
