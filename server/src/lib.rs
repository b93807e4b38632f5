//! gaps-server: the service around one shard's sans-IO core ([`gaps_shard::ShardCore`]).
//!
//! - [`service`]: the QUIC service: connections and streams feed the shard's actor thread through a
//!   bounded queue (small requests run on their connection's task when the core is idle); joins the
//!   coordinator; ticks leases.
//! - [`auth`]: who may send what (certificate roles, worker credentials), and rate-limited refusal logs.
//! - [`metrics`]: Prometheus export over a small hyper service.
//! - [`data`]: cuts the training files into the coordinator's dealt splits (dynamic data sharding).
//! - [`journal`]: the coordinator's dealer journal (async mode: a restore does not deal finished splits again).
//! - [`link`]: how a shard process reaches the coordinator, wherever a majority moved it.
//! - [`replication`]: replicated shards (`--replicas`): the primary's log, shipped to backups that keep a copy.
//! - [`quorum`]: shard 0's configuration chosen by a majority of the shard processes (each one's acceptor,
//!   the coordinator's proposals).
//! - [`record`]: a shard's request record and its replay (tests of replication; hidden flags).
//! - [`cli`]: flags and the process entry point (bin `gaps-server`).
//!
//! Architecture invariant: this crate links neither the worker, nor the models, nor the data readers
//! (`cargo tree -p gaps-server -e normal` shows no `gaps-worker` or `gaps-models`; enforced by
//! `cli/tests/architecture.rs`). A shard's layout comes from a layout file.

pub mod auth;
pub mod checkpoint;
pub mod cli;
pub mod data;
pub mod journal;
pub mod link;
pub mod metrics;
pub mod quorum;
pub mod record;
pub mod replication;
pub mod service;

pub use gaps_shard::{CoreEvent, Init, ShardConfig, ShardCore, ShardError};
pub use service::{RunningServer, ServiceConfig};

/// What the unit tests of several modules share.
#[cfg(test)]
pub(crate) mod test_support {
    use std::time::Duration;

    /// Shard `shard` of `num_shards` holding one 100-float tensor in chunks of 32, updated by `rule`.
    pub(crate) fn shard_config(shard: u32, num_shards: u32, rule: gaps_kernels::Rule) -> gaps_shard::ShardConfig {
        gaps_shard::ShardConfig {
            shard,
            num_shards,
            layout: gaps_common::layout::Layout::new(vec![gaps_common::layout::TensorSpec::new("w", 100)], 32)
                .expect("layout"),
            rule,
            hyper: gaps_kernels::Hyper::default(),
            init: gaps_shard::Init { seed: 1, std: 0.1 },
            lease: Duration::from_secs(5),
            advertise: "a:1".into(),
            epoch: 3,
            threads: 1,
            sparse: gaps_shard::SparseSettings::default(),
            modes: gaps_shard::modes::ModeConfig::default(),
        }
    }
}
