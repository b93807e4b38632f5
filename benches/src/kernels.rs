//! `gaps bench kernels`: parameters per second of every update rule's fast path, against a fused streaming
//! loop over the same bytes measured in the same run (see `gaps_kernels::stream_baseline`).

use anyhow::Result;
use gaps_kernels::resident::{Lookahead, PushBatch, ResidentState};
use gaps_kernels::{Bufs, Hyper, PushScalars, Rule};
use std::time::{Duration, Instant};

/// One measured (rule, size) case.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelResult {
    /// Rule name.
    pub rule: Rule,
    /// `cpu` or `cuda`.
    pub device: &'static str,
    /// Parameters per update.
    pub params: usize,
    /// Updates × parameters per second (on the CPU the median of the paired windows).
    pub params_per_s: f64,
    /// Bytes the rule reads and writes per parameter.
    pub bytes_per_param: usize,
    /// The baseline, parameters per second: the streaming loop over the same bytes (`update` path), or for
    /// the `server` path the CPU per-chunk path of the same push (host-resident) or the pinned-copy bound
    /// of the bytes that cross PCIe (GPU).
    pub stream_params_per_s: f64,
    /// Rule ÷ baseline: on the CPU the median of paired windows' ratios (see `paired`), on a GPU the
    /// ratio of the two rates.
    pub ratio: f64,
    /// `update` (the rule's loop on resident buffers) or `server` (a push and a pull through the shard's
    /// resident state: host gradient in, update, parameters out).
    pub path: &'static str,
}

impl KernelResult {
    /// Rule ÷ baseline.
    pub fn ratio(&self) -> f64 {
        self.ratio
    }

    /// The JSON line.
    pub fn to_json(&self) -> String {
        /// The JSON line.
        #[derive(serde::Serialize)]
        struct Line {
            rule: &'static str,
            device: &'static str,
            path: &'static str,
            params: usize,
            params_per_s: f64,
            bytes_per_param: usize,
            stream_params_per_s: f64,
            ratio: f64,
            gbytes_per_s: f64,
        }
        crate::json_line(&Line {
            rule: self.rule.name(),
            device: self.device,
            path: self.path,
            params: self.params,
            params_per_s: self.params_per_s.round(),
            bytes_per_param: self.bytes_per_param,
            stream_params_per_s: self.stream_params_per_s.round(),
            ratio: (self.ratio() * 1000.0).round() / 1000.0,
            gbytes_per_s: (self.params_per_s * self.bytes_per_param as f64 / 1e7).round() / 100.0,
        })
    }
}

/// Planar buffers of one benchmark case, filled with small non-zero values.
struct Planes {
    params: Vec<f32>,
    shared: Vec<f32>,
    worker: Vec<f32>,
    grad: Vec<f32>,
    read: Vec<f32>,
}

impl Planes {
    fn new(rule: Rule, n: usize) -> Self {
        let l = rule.layout();
        Planes {
            params: vec![0.5; n],
            shared: vec![0.01; l.shared_planes * n],
            worker: vec![0.01; l.worker_planes * n],
            grad: vec![1e-3; n],
            read: if l.needs_read { vec![0.4999; n] } else { Vec::new() },
        }
    }

    fn bufs(&mut self) -> Bufs<'_> {
        Bufs::from_planes(&mut self.params, &mut self.shared, &mut self.worker, &self.grad, &self.read)
    }
}

/// Calls per second of `f` over one timing window of at least `min_time` (at least one call).
fn rate(min_time: Duration, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    let started = Instant::now();
    let mut calls = 0u32;
    while calls == 0 || started.elapsed() < min_time {
        f()?;
        calls += 1;
    }
    Ok(f64::from(calls) / started.elapsed().as_secs_f64())
}

/// Rates of two workloads timed in back-to-back pairs of short windows (nine pairs, the order swapped every
/// pair; one pair in quick mode), so both sides of a pair see the same machine state: the median rate of
/// each and the median of the pairs' ratios a ÷ b. On a shared machine whose memory bandwidth drifts by 2×
/// within seconds, the paired median tracks the ratio where best-of-windows picks each side's luckiest
/// moment, which need not be the same moment.
pub(crate) fn paired(
    min_time: Duration,
    quick: bool,
    a: &mut dyn FnMut() -> Result<()>,
    b: &mut dyn FnMut() -> Result<()>,
) -> Result<(f64, f64, f64)> {
    a()?;
    b()?;
    let pairs = if quick { 1 } else { 9 };
    let window = min_time / (2 * pairs);
    let (mut rates_a, mut rates_b, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for pair in 0..pairs {
        let (ra, rb) = if pair % 2 == 0 {
            let ra = rate(window, a)?;
            (ra, rate(window, b)?)
        } else {
            let rb = rate(window, b)?;
            (rate(window, a)?, rb)
        };
        rates_a.push(ra);
        rates_b.push(rb);
        ratios.push(ra / rb.max(f64::MIN_POSITIVE));
    }
    Ok((crate::median(rates_a), crate::median(rates_b), crate::median(ratios)))
}

/// Measures every rule at every size on the CPU with `threads` threads.
pub fn run_cpu(sizes: &[usize], threads: usize, min_time: Duration, quick: bool) -> Result<Vec<KernelResult>> {
    let hyper = Hyper { lr: 1e-3, momentum: 0.9, weight_decay: 1e-4, dc_lambda: 0.5, dc_ms_decay: 0.95 };
    let mut out = Vec::new();
    for &n in sizes {
        for rule in Rule::ALL {
            let planes = std::cell::RefCell::new(Planes::new(rule, n));
            let mut t = 0u64;
            let mut update = || -> Result<()> {
                t += 1;
                let s = PushScalars { lr: 1e-3, lr_max: 1e-3, staleness: 3, t, workers: 8 };
                gaps_kernels::apply_par(rule, &hyper, &s, planes.borrow_mut().bufs(), threads)?;
                Ok(())
            };
            let mut stream = || -> Result<()> {
                gaps_kernels::stream_baseline(planes.borrow_mut().bufs(), threads);
                Ok(())
            };
            let (rule_rate, stream_rate, ratio) = paired(min_time, quick, &mut update, &mut stream)?;
            out.push(KernelResult {
                rule,
                // The vector width the loops ran with (GAPS_KERNEL_ISA can narrow it to compare paths).
                device: match gaps_kernels::isa() {
                    gaps_kernels::Isa::Avx512 => "cpu-avx512",
                    gaps_kernels::Isa::Avx2 => "cpu-avx2",
                    gaps_kernels::Isa::Baseline => "cpu",
                },
                params: n,
                params_per_s: rule_rate * n as f64,
                bytes_per_param: rule.bytes_per_param(),
                stream_params_per_s: stream_rate * n as f64,
                ratio,
                path: "update",
            });
        }
    }
    Ok(out)
}

/// Prints the table (stderr) and one JSON line per case (stdout when `json`).
pub fn print(results: &[KernelResult], json: bool) {
    eprintln!(
        "{:<18} {:>10} {:>10} {:>8} {:>12} {:>12} {:>9} {:>6}",
        "rule", "device", "params", "B/param", "Mparams/s", "stream Mp/s", "GB/s", "ratio"
    );
    for r in results {
        eprintln!(
            "{:<18} {:>10} {:>10} {:>8} {:>12.1} {:>12.1} {:>9.2} {:>6.2}",
            r.rule.name(),
            r.device,
            r.params,
            r.bytes_per_param,
            r.params_per_s / 1e6,
            r.stream_params_per_s / 1e6,
            r.params_per_s * r.bytes_per_param as f64 / 1e9,
            r.ratio()
        );
    }
    if json {
        for r in results {
            println!("{}", r.to_json());
        }
    }
}

/// Measures every rule at every size on the GPU, against device-to-device copy bandwidth.
pub fn run_cuda(device: &gaps_kernels::cuda::CudaDevice, sizes: &[usize], quick: bool) -> Result<Vec<KernelResult>> {
    let hyper = Hyper { lr: 1e-3, momentum: 0.9, weight_decay: 1e-4, dc_lambda: 0.5, dc_ms_decay: 0.95 };
    let reps = if quick { 1 } else { 20 };
    let mut out = Vec::new();
    for &n in sizes {
        // Bytes moved per second by cudaMemcpy device to device (each byte read once and written once).
        let copy_bytes_per_s = device.copy_bandwidth(n * 16, reps)?;
        for rule in Rule::ALL {
            let mut planes = Planes::new(rule, n);
            let mut block = device.upload(rule, &planes.bufs())?;
            let seconds = device.time_update(rule, &hyper, &mut block, reps)?;
            out.push(KernelResult {
                rule,
                device: "cuda",
                params: n,
                params_per_s: n as f64 / seconds.max(1e-12),
                bytes_per_param: rule.bytes_per_param(),
                stream_params_per_s: copy_bytes_per_s / rule.bytes_per_param() as f64,
                ratio: n as f64 / seconds.max(1e-12) / (copy_bytes_per_s / rule.bytes_per_param() as f64),
                path: "update",
            });
        }
    }
    Ok(out)
}

/// Chunk size of the server-path cases (the layout default's order of magnitude).
const SERVER_CHUNK: usize = 1 << 18;

/// Bytes that cross to and from the device per parameter in one push and one pull: the gradient, the echo
/// where the rule takes one, and the parameters (DANA's look-ahead also its momentum plane).
fn server_bytes_per_param(rule: Rule) -> usize {
    let l = rule.layout();
    4 * (1 + usize::from(l.needs_read)) + 4 * (1 + usize::from(l.lookahead))
}

/// One push and one pull of `n` parameters through a shard's resident state on `device`: the staged
/// gradient (and echo) in, one pass over the chunk table, every chunk's parameters (or look-ahead) out.
fn resident_round(
    resident: &mut dyn ResidentState,
    rule: Rule,
    hyper: &Hyper,
    staged: &[f32],
    out: &mut Vec<f32>,
    t: u64,
) -> Result<()> {
    let chunks: Vec<usize> = (0..resident.layout().slots().len()).collect();
    let s = PushScalars { lr: 1e-3, lr_max: 1e-3, staleness: 3, t, workers: 8 };
    let (grads, reads) = staged.split_at(resident.layout().arena_sizes().params as usize);
    let (hypers, scalars) = (vec![*hyper; chunks.len()], vec![s; chunks.len()]);
    resident.push(PushBatch { chunks: &chunks, worker_slot: 0, hypers: &hypers, scalars: &scalars, grads, reads })?;
    out.clear();
    let looks = vec![Lookahead { hyper, lr: 1e-3, workers: 8 }; chunks.len()];
    resident.pull(&chunks, &looks, out)?;
    let _ = rule;
    Ok(())
}

fn resident_for<D: gaps_kernels::resident::Device>(
    device: D,
    rule: Rule,
    n: usize,
) -> Result<(gaps_kernels::resident::Resident<D>, Vec<f32>)> {
    let chunks: Vec<(u32, Rule)> =
        (0..n.div_ceil(SERVER_CHUNK)).map(|c| ((SERVER_CHUNK.min(n - c * SERVER_CHUNK)) as u32, rule)).collect();
    let layout = gaps_kernels::plan::DeviceLayout::new(&chunks, 1)?;
    let mut resident = gaps_kernels::resident::Resident::new(device, layout)?;
    let l = rule.layout();
    for (c, (len, _)) in chunks.iter().enumerate() {
        let len = *len as usize;
        let shared = vec![0.01f32; len];
        let planes: Vec<&[f32]> = (0..l.shared_planes).map(|_| shared.as_slice()).collect();
        let worker: Vec<&[f32]> = (0..l.worker_planes).map(|_| shared.as_slice()).collect();
        resident.load_chunk(c, &vec![0.5; len], &planes, &worker)?;
    }
    let mut staged = vec![1e-3f32; n];
    if l.needs_read {
        staged.extend(std::iter::repeat_n(0.4999f32, n));
    }
    Ok((resident, staged))
}

/// The server's push path on the host: a push and a pull of `n` parameters through the resident executor on
/// host memory (`HostDevice`), against the shard's CPU per-chunk path of the same push in the same run (one
/// `apply_par` per chunk on its own planes, then the pull's copy of every chunk's parameters).
pub fn run_server_host(sizes: &[usize], threads: usize, min_time: Duration, quick: bool) -> Result<Vec<KernelResult>> {
    let hyper = Hyper { lr: 1e-3, momentum: 0.9, weight_decay: 1e-4, dc_lambda: 0.5, dc_ms_decay: 0.95 };
    let mut out = Vec::new();
    for &n in sizes {
        for rule in Rule::ALL {
            let (mut resident, staged) = resident_for(gaps_kernels::resident::HostDevice, rule, n)?;
            let mut pulled = Vec::with_capacity(n);
            let mut t = 0u64;
            let mut through_resident = || -> Result<()> {
                t += 1;
                resident_round(&mut resident, rule, &hyper, &staged, &mut pulled, t)
            };
            let mut chunks: Vec<Planes> = (0..n.div_ceil(SERVER_CHUNK))
                .map(|c| Planes::new(rule, SERVER_CHUNK.min(n - c * SERVER_CHUNK)))
                .collect();
            let mut copy = Vec::with_capacity(n);
            let mut u = 0u64;
            let mut per_chunk = || -> Result<()> {
                u += 1;
                let s = PushScalars { lr: 1e-3, lr_max: 1e-3, staleness: 3, t: u, workers: 8 };
                copy.clear();
                for planes in &mut chunks {
                    gaps_kernels::apply_par(rule, &hyper, &s, planes.bufs(), threads)?;
                    gaps_kernels::pull_values(rule, &hyper, 1e-3, 8, &planes.params, &planes.shared, &mut copy);
                }
                Ok(())
            };
            let (resident_rate, cpu_rate, ratio) = paired(min_time, quick, &mut through_resident, &mut per_chunk)?;
            out.push(KernelResult {
                rule,
                device: "host-resident",
                params: n,
                params_per_s: resident_rate * n as f64,
                bytes_per_param: server_bytes_per_param(rule),
                stream_params_per_s: cpu_rate * n as f64,
                ratio,
                path: "server",
            });
        }
    }
    Ok(out)
}

/// The server's push path on the GPU: a push and a pull of `n` parameters through the resident state in GPU
/// memory (pinned staging, one table launch, parameters copied back), against the bound of the bytes that
/// cross PCIe copied between pinned memory and the device in the same run.
pub fn run_server_cuda(sizes: &[usize], quick: bool) -> Result<Vec<KernelResult>> {
    let hyper = Hyper { lr: 1e-3, momentum: 0.9, weight_decay: 1e-4, dc_lambda: 0.5, dc_ms_decay: 0.95 };
    let reps = if quick { 1 } else { 20 };
    let mut out = Vec::new();
    for &n in sizes {
        for rule in Rule::ALL {
            let gpu = gaps_kernels::cuda::CudaArenas::open(0)?;
            let bound = gpu.pinned_copy_bandwidth(n * server_bytes_per_param(rule), reps)?;
            let (mut resident, staged) = resident_for(gpu, rule, n)?;
            let mut pulled = Vec::with_capacity(n);
            resident_round(&mut resident, rule, &hyper, &staged, &mut pulled, 1)?;
            let started = Instant::now();
            for t in 0..reps {
                resident_round(&mut resident, rule, &hyper, &staged, &mut pulled, u64::from(t) + 2)?;
            }
            let seconds = started.elapsed().as_secs_f64() / f64::from(reps);
            out.push(KernelResult {
                rule,
                device: "cuda-resident",
                params: n,
                params_per_s: n as f64 / seconds.max(1e-12),
                bytes_per_param: server_bytes_per_param(rule),
                stream_params_per_s: bound / server_bytes_per_param(rule) as f64,
                ratio: n as f64 / seconds.max(1e-12) / (bound / server_bytes_per_param(rule) as f64),
                path: "server",
            });
        }
    }
    Ok(out)
}
