//! Criteo-layout data for Python: a worker's stream of samples (`CriteoStream`), the dealt splits of a file
//! (`SplitReader`), held-out samples and the AUC.

use super::*;

pub(super) fn data_spec(data: &str, seed: u64) -> PyResult<DataSpec> {
    match data.parse::<DataSpec>().map_err(|e| err("config", e))? {
        DataSpec::Synthetic { .. } => Ok(DataSpec::Synthetic { seed }),
        file => Ok(file),
    }
}

/// Samples as bytes: labels, integer features, ids (see `held_out`).
pub(super) type SampleBytes<'py> = (Bound<'py, PyByteArray>, Bound<'py, PyByteArray>, Bound<'py, PyByteArray>);

/// Samples as (labels: float32 bytes, integer features: `n × 13` float32 bytes of log(1 + max(x, 0)) as the
/// built-in models use, categorical ids: `n × 26` uint64 bytes, `2**64 − 1` where missing).
pub(super) fn sample_bytes<'py>(py: Python<'py>, samples: &[gaps_models::criteo::Sample]) -> SampleBytes<'py> {
    use gaps_models::criteo::{NUM_CAT, NUM_INT};
    let labels: Vec<f32> = samples.iter().map(|s| f32::from(s.label)).collect();
    let ints: Vec<f32> = samples.iter().flat_map(|s| (0..NUM_INT).map(move |j| s.log_int(j))).collect();
    let ids: Vec<u64> =
        samples.iter().flat_map(|s| (0..NUM_CAT).map(move |f| s.feature_id(f).unwrap_or(u64::MAX))).collect();
    (
        PyByteArray::new(py, bytemuck::cast_slice(&labels)),
        PyByteArray::new(py, bytemuck::cast_slice(&ints)),
        PyByteArray::new(py, bytemuck::cast_slice(&ids)),
    )
}

/// Criteo-layout training data, as the built-in workers read it: the seeded synthetic generator (`data`
/// = "synthetic") or a TSV file, worker `part` of `parts` (every 10th line of a file is held out).
#[pyclass(module = "gaps._gaps")]
pub(super) struct CriteoStream {
    stream: Mutex<TrainingStream>,
}

#[pymethods]
impl CriteoStream {
    #[new]
    fn new(data: &str, seed: u64, part: u64, parts: u64) -> PyResult<Self> {
        let spec = data_spec(data, seed)?;
        let (part, parts) = match spec {
            DataSpec::Synthetic { .. } => (part, 1),
            _ => (part, parts),
        };
        let stream = TrainingStream::new(&spec, part, parts).map_err(|e| err("config", e))?;
        Ok(CriteoStream { stream: Mutex::new(stream) })
    }

    /// The next `n` samples: (labels, integer features, ids) as bytes (see `held_out`).
    fn next_batch<'py>(&self, py: Python<'py>, n: usize) -> PyResult<SampleBytes<'py>> {
        // Parsing (or generating) runs without the GIL, so a reader thread prefetches beside the training.
        let samples =
            py.allow_threads(|| self.stream.lock().map_err(poisoned)?.next_batch(n).map_err(|e| err("config", e)))?;
        Ok(sample_bytes(py, &samples))
    }
}

/// The training samples of one dealt split (see `NativeClient.next_split`): the lines of its byte range of
/// file `file` of `data` (held-out lines skipped, as the built-in workers do), or its synthetic samples.
#[pyclass(module = "gaps._gaps")]
pub(super) struct SplitReader {
    samples: Mutex<gaps_models::criteo::SplitSamples>,
}

#[pymethods]
impl SplitReader {
    #[new]
    #[pyo3(signature = (data, seed, files, file, first_line, start, end))]
    fn new(data: &str, seed: u64, files: u32, file: u32, first_line: u64, start: u64, end: u64) -> PyResult<Self> {
        let samples = match data_spec(data, seed)? {
            DataSpec::Synthetic { seed } if files == 0 => gaps_models::criteo::SplitSamples::synthetic(
                gaps_models::criteo::SyntheticCriteo::shared(seed),
                start,
                end,
            ),
            DataSpec::Files(paths) if files as usize == paths.len() => {
                let path = paths.get(file as usize).ok_or_else(|| err("config", format!("no data file {file}")))?;
                gaps_models::criteo::SplitSamples::file(path, first_line, start, end).map_err(|e| err("config", e))?
            }
            _ => {
                return Err(err(
                    "config",
                    format!(
                    "the coordinator deals {files} data file(s) (0: synthetic data), this reader was given {data:?}: \
                         give every worker the coordinator's --data, in the same order"
                ),
                ))
            }
        };
        Ok(SplitReader { samples: Mutex::new(samples) })
    }

    /// The next (up to) `n` samples as (labels, integer features, ids) bytes (see `held_out`); empty once the
    /// split is used up.
    fn next_batch<'py>(&self, py: Python<'py>, n: usize) -> PyResult<SampleBytes<'py>> {
        let samples =
            py.allow_threads(|| self.samples.lock().map_err(poisoned)?.next_batch(n).map_err(|e| err("config", e)))?;
        Ok(sample_bytes(py, &samples))
    }

    /// Bad lines met in the split so far.
    fn bad_lines(&self) -> PyResult<u64> {
        Ok(self.samples.lock().map_err(poisoned)?.bad_lines())
    }
}

/// The held-out samples the built-in evaluation uses: (labels, integer features, ids) as bytes, with
/// labels float32, features `n × 13` float32, ids `n × 26` uint64 (`2**64 − 1` where missing).
#[pyfunction]
pub(super) fn held_out<'py>(py: Python<'py>, data: &str, seed: u64, n: usize) -> PyResult<SampleBytes<'py>> {
    let held = gaps_models::criteo::held_out(&data_spec(data, seed)?, n).map_err(|e| err("config", e))?;
    Ok(sample_bytes(py, &held.samples))
}

/// The area under the ROC curve of `scores` (float32 bytes) for 0/1 `labels` (float32 bytes), as the
/// built-in evaluation computes it.
#[pyfunction]
pub(super) fn auc(scores: &[u8], labels: &[u8]) -> PyResult<f64> {
    if scores.len() != labels.len() || scores.len() % 4 != 0 {
        return Err(err("shape", "scores and labels must be float32 arrays of one length"));
    }
    let n = scores.len() / 4;
    let scores = floats("scores", scores, n)?;
    let labels: Vec<u8> = floats("labels", labels, n)?.iter().map(|l| u8::from(*l > 0.5)).collect();
    Ok(gaps_models::criteo::auc(&scores, &labels))
}
