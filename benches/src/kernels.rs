//! `gaps bench kernels`: parameters per second of every update rule's fast path, against a fused streaming
//! loop over the same bytes measured in the same run (see `gaps_kernels::stream_baseline`).

use anyhow::Result;
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
    /// Updates × parameters per second.
    pub params_per_s: f64,
    /// Bytes the rule reads and writes per parameter.
    pub bytes_per_param: usize,
    /// The streaming baseline over the same bytes, parameters per second.
    pub stream_params_per_s: f64,
}

impl KernelResult {
    /// rule ÷ baseline.
    pub fn ratio(&self) -> f64 {
        self.params_per_s / self.stream_params_per_s.max(f64::MIN_POSITIVE)
    }

    /// The JSON line.
    pub fn to_json(&self) -> String {
        serde_json::json!({
            "rule": self.rule.name(),
            "device": self.device,
            "params": self.params,
            "params_per_s": self.params_per_s.round(),
            "bytes_per_param": self.bytes_per_param,
            "stream_params_per_s": self.stream_params_per_s.round(),
            "ratio": (self.ratio() * 1000.0).round() / 1000.0,
            "gbytes_per_s": (self.params_per_s * self.bytes_per_param as f64 / 1e7).round() / 100.0,
        })
        .to_string()
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

/// Calls per second of `f` over one timing window of at least `min_time` (at least three calls; one in
/// quick mode).
fn rate(min_time: Duration, quick: bool, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    let started = Instant::now();
    let mut calls = 0u32;
    while calls == 0 || (!quick && (started.elapsed() < min_time || calls < 3)) {
        f()?;
        calls += 1;
    }
    Ok(f64::from(calls) / started.elapsed().as_secs_f64())
}

/// Best rates of two workloads timed in alternating windows (three each), so both see the same machine
/// state; the best window is the least disturbed one.
fn best_alternating(
    min_time: Duration,
    quick: bool,
    a: &mut dyn FnMut() -> Result<()>,
    b: &mut dyn FnMut() -> Result<()>,
) -> Result<(f64, f64)> {
    a()?;
    b()?;
    let rounds = if quick { 1 } else { 3 };
    let (mut best_a, mut best_b) = (0.0f64, 0.0f64);
    for _ in 0..rounds {
        best_a = best_a.max(rate(min_time / 3, quick, a)?);
        best_b = best_b.max(rate(min_time / 3, quick, b)?);
    }
    Ok((best_a, best_b))
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
            let (rule_rate, stream_rate) = best_alternating(min_time, quick, &mut update, &mut stream)?;
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
            });
        }
    }
    Ok(out)
}
