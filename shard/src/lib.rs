//! gaps-shard: the sans-IO state machine of one parameter-server shard.
//!
//! [`ShardCore`] owns a shard's dense chunks, optimizer state, versions, exactly-once windows, worker
//! leases, training modes and sparse embedding tables, and (on shard 0) the coordinator's membership. It is
//! driven only by [`ShardCore::handle`] (one request frame in, one reply frame out) and [`ShardCore::tick`];
//! time is an argument. The QUIC service (`gaps-server`), the simulator (`gaps-sim`) and the tests all
//! drive this same type.
//!
//! Architecture invariant: this crate knows nothing of tokio, quinn, metrics or clap, and never reads a
//! clock, a socket or a file (`cargo tree -p gaps-shard -e normal` shows none of them; the test
//! `sans_io_dependencies` in `cli/tests/architecture.rs` enforces it).

pub mod checkpoint;
pub mod core;
pub mod dealer;
pub mod modes;
pub mod replica;
pub mod schedule;
pub mod sparse;
pub mod stripes;
pub mod testnet;

pub use crate::checkpoint::CheckpointError;
pub use crate::core::{
    append_reply_values, CoreEvent, Init, PeerShard, Readiness, ShardConfig, ShardCore, ShardError, SparseSettings,
    RESTART_ID_GAP, SEQ_WINDOW,
};
pub use crate::modes::{Mode, ModeConfig};
