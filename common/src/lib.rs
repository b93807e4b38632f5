//! gaps-common: the pieces every gaps process shares.
//!
//! - [`wire`]: the frame format (a bincode-2 header plus raw little-endian tensor bytes), every message,
//!   and the limits that bound every length before allocation.
//! - [`layout`]: how dense tensors are cut into chunks and which shard owns which chunk.
//! - [`layout_file`]: the TOML/JSON layout file a shard serves.
//! - [`rng`]: a small, seedable, bit-reproducible random number generator.
//! - [`dtype`]: the 16-bit wire formats (bfloat16, IEEE half) and their conversions.
//! - [`buffers`]: a bounded recycler for very large `f32` buffers (payloads of many-MiB tensors).
//! - [`identity`]: who a certificate says its holder is (its SPIFFE URI name, its validity), read with
//!   x509-parser, fuzzed (`fuzz/fuzz_targets/identity.rs`).
//! - [`quorum`]: shard 0's configuration (who serves the coordinator's shard, with which backups in sync),
//!   chosen by a majority of the shard processes (single-decree Paxos per version), sans-IO.
//!
//! Architecture invariant: this crate has no async runtime and no networking; `cargo tree -p gaps-common`
//! shows neither tokio nor quinn, nor TLS: certificates are made in `gaps-setup` and verified in `gaps-transport`
//! (only the name and validity a certificate carries are read here).

pub mod buffers;
pub mod config;
pub mod dtype;
pub mod identity;
pub mod layout;
pub mod layout_file;
pub mod quorum;
pub mod rng;
pub mod wire;

/// An empty folder `{name}-{pid}` under the system's temporary folder (one left by an earlier process of the
/// same id removed first): where a test, a bench or `gaps local` keeps its files.
pub fn scratch_dir(name: &str) -> std::io::Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
    match std::fs::remove_dir_all(&dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

pub use layout::{ChunkId, Layout, LayoutError, TensorSpec};
pub use wire::{ErrorCode, Frame, Message, WireError};
