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
