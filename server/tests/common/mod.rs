//! Helpers the server's integration tests share: a client's options, a worker's made-up gradients.
#![allow(dead_code)] // each test file is its own crate and uses some of them

use gaps_common::layout::{Layout, SparseSpec, TensorSpec};
use gaps_common::wire::Role;
use gaps_setup::certs::ClusterCerts;
use gaps_worker::client::{ClientOptions, Snapshot};
use std::time::Duration;

/// Options for a client of `role` named `name` reaching the cluster at `addr` with the cluster's worker
/// certificate, each RPC given `rpc_timeout`.
pub fn options(certs: &ClusterCerts, addr: &str, role: Role, name: &str, rpc_timeout: Duration) -> ClientOptions {
    let mut o = ClientOptions::new(addr, certs.worker_material().expect("worker tls"), role, name);
    o.rpc_timeout = rpc_timeout;
    o
}

/// Worker `w`'s gradient at its step `i` for every tensor of `s`: a tenth of each parameter plus a small
/// offset that varies with the step, so that pushes differ and the model moves.
pub fn toy_gradients(s: &Snapshot, i: usize, w: usize) -> Vec<Vec<f32>> {
    let offset = ((i + w) % 5) as f32 * 0.01;
    s.tensors.iter().map(|t| t.iter().map(|v| v * 0.1 + offset).collect()).collect()
}

/// A model of a weight `w` of `weights` floats and a bias `b` of `biases`, cut into chunks of `chunk`
/// floats, with one embedding table `emb` of rows of `dim` floats.
pub fn weights_bias_table(weights: u64, biases: u64, chunk: u32, dim: u32) -> Layout {
    Layout::with_tables(
        vec![TensorSpec::new("w", weights), TensorSpec::new("b", biases)],
        chunk,
        vec![SparseSpec::new("emb", dim)],
    )
    .expect("layout")
}

/// A folder of this process for `name` under the temporary directory, emptied of what an earlier run left.
pub fn fresh_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}
