//! gaps-common: the pieces every gaps process shares.
//!
//! - [`wire`]: the frame format (a bincode-2 header plus raw little-endian tensor bytes), every message,
//!   and the limits that bound every length before allocation.
//! - [`layout`]: how dense tensors are cut into chunks and which shard owns which chunk.
//! - [`rng`]: a small, seedable, bit-reproducible random number generator.
//! - [`tls`]: the cluster CA, certificates, and the rustls configurations for mutual TLS (ring only).
//!
//! Architecture invariant: this crate has no async runtime and no networking; `cargo tree -p gaps-common`
//! shows neither tokio nor quinn.

pub mod config;
pub mod layout;
pub mod rng;
pub mod tls;
pub mod wire;

pub use layout::{ChunkId, Layout, LayoutError, TensorSpec};
pub use wire::{ErrorCode, Frame, Message, WireError};
