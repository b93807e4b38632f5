//! `gaps bench checkpoint`: how long a shard pauses to snapshot its state, how long writing the files takes
//! (in the background of training), and how long a restart needs to read, verify and restore them — for one
//! shard holding `params` parameters with momentum (θ and v: 8 bytes per parameter).

use anyhow::{anyhow, Context, Result};
use gaps_common::layout::{Layout, TensorSpec};
use gaps_kernels::{Hyper, Rule};
use gaps_server::checkpoint::{load_verified, CheckpointStore};
use gaps_shard::{Init, ShardConfig, ShardCore};
use std::path::Path;
use std::time::Instant;

/// One measurement.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointResult {
    /// Parameters held by the shard.
    pub params: u64,
    /// Bytes of the checkpoint file.
    pub bytes: u64,
    /// Seconds the core paused to copy its state into a new buffer (the first checkpoint)…
    pub snapshot_s: f64,
    /// …and into the previous checkpoint's buffer (every later one).
    pub snapshot_reused_s: f64,
    /// Seconds to write the files (temporary name, fsync, rename, manifest, fsync of the directory).
    pub write_s: f64,
    /// Seconds to read the file back and check its CRC-32.
    pub read_s: f64,
    /// Seconds to rebuild the shard from the bytes.
    pub restore_s: f64,
}

impl CheckpointResult {
    /// The JSON line.
    pub fn to_json(&self) -> String {
        let gib = self.bytes as f64 / f64::from(1u32 << 30);
        /// The JSON line.
        #[derive(serde::Serialize)]
        struct Line {
            case: &'static str,
            params: u64,
            bytes: u64,
            snapshot_s: f64,
            snapshot_reused_s: f64,
            write_s: f64,
            read_s: f64,
            restore_s: f64,
            pause_s_per_gib: f64,
            first_pause_s_per_gib: f64,
        }
        crate::json_line(&Line {
            case: "checkpoint",
            params: self.params,
            bytes: self.bytes,
            snapshot_s: self.snapshot_s,
            snapshot_reused_s: self.snapshot_reused_s,
            write_s: self.write_s,
            read_s: self.read_s,
            restore_s: self.restore_s,
            pause_s_per_gib: self.snapshot_reused_s / gib.max(1e-12),
            first_pause_s_per_gib: self.snapshot_s / gib.max(1e-12),
        })
    }
}

/// Measures one shard of `params` parameters, writing under `dir`.
pub fn run(params: u64, dir: &Path) -> Result<CheckpointResult> {
    let cfg = ShardConfig {
        rule: Rule::Momentum,
        hyper: Hyper { lr: 0.01, momentum: 0.9, ..Hyper::default() },
        init: Init { seed: 1, std: 0.01 },
        advertise: "bench".into(),
        threads: 0,
        ..ShardConfig::new(Layout::new(vec![TensorSpec::new("w", params)], 1 << 20)?)
    };
    let core = ShardCore::new(cfg.clone()).map_err(|e| anyhow!("{e}"))?;
    let started = Instant::now();
    let bytes = core.checkpoint(1).map_err(|e| anyhow!("{e}"))?;
    let snapshot_s = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let bytes = core.checkpoint_into(1, bytes).map_err(|e| anyhow!("{e}"))?;
    let snapshot_reused_s = started.elapsed().as_secs_f64();
    drop(core);
    let info = ShardCore::checkpoint_info(&bytes).map_err(|e| anyhow!("{e}"))?;
    let store = CheckpointStore::open(dir, 0, 1)?;
    let started = Instant::now();
    let path = store.write(&info, 0, None, true, &bytes).context("writing the checkpoint")?;
    let write_s = started.elapsed().as_secs_f64();
    let size = bytes.len() as u64;
    drop(bytes);
    let started = Instant::now();
    let read = load_verified(&path, &path.with_extension("json"))?;
    let read_s = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let restored = ShardCore::restore(cfg, &read).map_err(|e| anyhow!("{e}"))?;
    let restore_s = started.elapsed().as_secs_f64();
    drop(restored);
    Ok(CheckpointResult { params, bytes: size, snapshot_s, snapshot_reused_s, write_s, read_s, restore_s })
}
