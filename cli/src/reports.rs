//! The JSON lines `gaps` prints (for scripts and launchers), each a typed struct: a reader deserializes the
//! same struct, so a renamed or missing field is an error rather than a silent default. The per-command
//! results (`gaps local`'s summary, the benches' lines) are built next to the code that measures them;
//! the small event lines of the front door live here.

use serde::{Deserialize, Serialize};

/// One JSON line for any report (NaN and infinities become `null`, as JSON has no such numbers).
pub fn line<T: Serialize>(report: &T) -> String {
    // Serializing a struct of numbers, strings, options and vectors into a string cannot fail.
    serde_json::to_string(report).unwrap_or_else(|e| format!("{{\"error\":\"the report did not encode: {e}\"}}"))
}

/// `gaps checkpoint`: one line per shard that wrote the checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointWritten {
    /// Always `checkpoint`.
    pub event: String,
    /// The checkpoint's id (the same on every shard).
    pub id: u64,
    /// The shard.
    pub shard: u32,
    /// The snapshot file on the shard's machine.
    pub path: String,
    /// Synchronous/GBA steps the shard had applied when it took the snapshot.
    pub step: u64,
}

/// `gaps cluster`: the line printed once every shard serves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterUp {
    /// Always `cluster`.
    pub event: String,
    /// The coordinator's address (shard 0).
    pub coordinator: Option<String>,
    /// The cluster's folder (certificates, logs).
    pub dir: String,
    /// The cluster CA's certificate.
    pub ca: String,
    /// A worker certificate and its key.
    pub cert: String,
    /// The key of `cert`.
    pub key: String,
}

/// Reads back a number that [`line`] may have written as `null` (NaN or an infinity) as NaN, so that a
/// report with a NaN reads back as its type instead of failing (a missing field still fails).
pub fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// [`nan_if_null`] for an `f32`.
pub fn nan_if_null_f32<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f32, D::Error> {
    Ok(Option::<f32>::deserialize(d)?.unwrap_or(f32::NAN))
}

#[cfg(test)]
mod tests {
    use crate::local::TimelinePoint;

    #[test]
    fn a_nan_reads_back_as_nan_and_a_missing_field_is_an_error() {
        let p = TimelinePoint { t_s: 1.5, auc: f64::NAN, logloss: 0.25 };
        let text = super::line(&p);
        assert_eq!(text, r#"{"t_s":1.5,"auc":null,"logloss":0.25}"#);
        let back: TimelinePoint = serde_json::from_str(&text).expect("reads back");
        assert!(back.auc.is_nan() && back.t_s == 1.5 && back.logloss == 0.25);
        assert!(serde_json::from_str::<TimelinePoint>(r#"{"t_s":1.5,"logloss":0.25}"#).is_err());
    }
}
