//! `gaps bench e2e`: end-to-end training throughput of the DLRM-style model through `gaps local` (real
//! shard and worker processes on loopback, mutual TLS) for several cluster shapes.

use crate::local::{run_with, LocalArgs};
use anyhow::{Context, Result};
use clap::Parser;
use std::path::Path;

#[derive(Debug, Parser)]
struct Wrapper {
    #[command(flatten)]
    args: LocalArgs,
}

/// One measured cluster shape.
#[derive(Debug, Clone, PartialEq)]
pub struct E2eResult {
    /// Shards.
    pub servers: u32,
    /// Workers.
    pub workers: u32,
    /// Training samples per second over all workers.
    pub samples_per_s: f64,
    /// Held-out AUC at the end.
    pub auc: f64,
}

impl E2eResult {
    /// The JSON line.
    pub fn to_json(&self) -> String {
        serde_json::json!({
            "case": format!("dlrm_{}x{}", self.servers, self.workers),
            "servers": self.servers,
            "workers": self.workers,
            "samples_per_s": self.samples_per_s.round(),
            "auc": (self.auc * 10_000.0).round() / 10_000.0,
        })
        .to_string()
    }
}

/// Runs DLRM on synthetic data for each (servers, workers) shape with `steps` steps per worker.
pub async fn run(exe: &Path, shapes: &[(u32, u32)], steps: u64) -> Result<Vec<E2eResult>> {
    let mut out = Vec::new();
    for (servers, workers) in shapes {
        let argv = ["local", "--model", "dlrm", "--data", "synthetic"]
            .iter()
            .map(|s| s.to_string())
            .chain([
                format!("--servers={servers}"),
                format!("--workers={workers}"),
                format!("--steps={steps}"),
                "--eval-samples=4096".into(),
            ])
            .collect::<Vec<_>>();
        let args = Wrapper::try_parse_from(&argv).context("building the local-cluster flags")?.args;
        let report = run_with(&args, exe).await?;
        let ctr = report.ctr.context("a CTR run reports samples per second")?;
        out.push(E2eResult { servers: *servers, workers: *workers, samples_per_s: ctr.samples_per_s, auc: ctr.auc });
    }
    Ok(out)
}
