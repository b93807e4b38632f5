//! gaps-server: one parameter-server shard.
//!
//! - [`core`]: the sans-IO shard state machine (chunks, versions, staleness, exactly-once, coordinator).
//! - [`service`]: the QUIC service around it.
//! - [`metrics`]: Prometheus export.
//! - [`cli`]: flags and the process entry point.

pub mod cli;
pub mod core;
pub mod metrics;
pub mod modes;
pub mod service;
pub mod sparse;

pub use crate::core::{CoreEvent, Init, ShardConfig, ShardCore, ShardError};
pub use service::{RunningServer, ServiceConfig};
