//! gaps-benches: the measurement code behind `gaps bench` and the bench targets.
//!
//! - [`transport`]: `gaps bench transport`.
//! - [`kernels`]: `gaps bench kernels`.
//! - [`tables`]: `gaps bench tables`.
//! - [`checkpoint`]: `gaps bench checkpoint`.
//! - [`codec`]: `cargo bench --bench codec` (wire-format decoding into large buffers).

pub mod checkpoint;

/// One bench result as a JSON line (NaN as null).
pub fn json_line<T: serde::Serialize>(result: &T) -> String {
    serde_json::to_string(result).unwrap_or_else(|e| format!("{{\"error\":\"the result did not encode: {e}\"}}"))
}

pub mod codec;
pub mod hog;
pub mod kernels;
mod shards;
pub mod tables;
pub mod transport;

/// The middle value of `values` (the upper one of an even count; 0 when there are none).
pub(crate) fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}
