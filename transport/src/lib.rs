//! gaps-transport: the one QUIC + mutual-TLS transport every gaps process uses.
//!
//! - [`tls`]: the cluster CA, certificates, and the rustls configurations for mutual TLS (ring only).
//! - [`net`]: transport tuning, endpoints, frame I/O over one bidirectional stream per RPC, one-RPC `call`.
//!
//! Servers and workers both build on this crate; neither depends on the other.

pub mod config_file;
/// Who a certificate says its holder is: [`gaps_common::identity`] (kept here under its old path).
pub use gaps_common::identity;
pub mod net;
pub mod tls;

pub use net::RpcError;

/// Installs the `tracing` subscriber used by every gaps binary: human-readable lines on stderr, filtered
/// by `GAPS_LOG` (default: `default_level`, e.g. `info`).
pub fn init_logging(default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("GAPS_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).try_init();
}
