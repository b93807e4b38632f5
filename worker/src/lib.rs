//! gaps-worker: the client library (registration, routing, concurrent push/pull with exactly-once retries),
//! the QUIC plumbing shared with the servers, the built-in models and data, and the training loop.

pub mod client;
pub mod criteo;
pub mod data;
pub mod model;
pub mod net;
pub mod recsys;
pub mod train;

pub use client::{Client, ClientError, ClientOptions, PushSummary, Snapshot};

/// Installs the `tracing` subscriber used by every gaps binary: human-readable lines on stderr, filtered
/// by `GAPS_LOG` (default: `default_level`, e.g. `info`).
pub fn init_logging(default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("GAPS_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).try_init();
}
