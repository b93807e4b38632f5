//! gaps-cli: the front door `gaps` and the code behind its own subcommands.
//!
//! - [`local`]: `gaps local`, a whole cluster of real `gaps-server` / `gaps-worker` processes on loopback.
//! - [`cluster`]: `gaps cluster`, shards for a layout file kept running for a training script.
//! - [`reports`]: the JSON lines the front door prints, as typed structs.
//! - [`e2e`]: `gaps bench e2e`, training throughput through local clusters (its bench target lives here
//!   because it runs this crate's binary).
//!
//! `gaps sim` is the `gaps-sim` crate, `gaps bench transport|kernels|tables` the `gaps-benches` crate,
//! `gaps server` / `gaps worker` the `gaps-server` / `gaps-worker` crates.

pub mod cluster;
pub mod e2e;
pub mod local;
pub mod reference;
pub mod reports;
pub mod stragglers;
