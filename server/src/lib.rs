//! gaps-server: the service around one shard's sans-IO core ([`gaps_shard::ShardCore`]).
//!
//! - [`service`]: the QUIC service: connections and streams feed the shard's actor thread through a
//!   bounded queue; joins the coordinator; ticks leases.
//! - [`auth`]: who may send what (certificate roles, worker credentials), and rate-limited refusal logs.
//! - [`metrics`]: Prometheus export over a small hyper service.
//! - [`data`]: cuts the training files into the coordinator's dealt splits (dynamic data sharding).
//! - [`journal`]: the coordinator's dealer journal (async mode: a restore does not deal finished splits again).
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
pub mod metrics;
pub mod quorum;
pub mod record;
pub mod replication;
pub mod service;

pub use gaps_shard::{CoreEvent, Init, ShardConfig, ShardCore, ShardError};
pub use service::{RunningServer, ServiceConfig};
