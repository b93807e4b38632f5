//! gaps-transport: the one QUIC + mutual-TLS transport every gaps process uses.
//!
//! - [`tls`]: TLS material (the cluster CA, this process's certificate and key) and the rustls configurations
//!   for mutual TLS (ring only); certificates are issued by `gaps-setup`.
//! - [`net`]: transport tuning, endpoints, frame I/O over one bidirectional stream per RPC, one-RPC `call`.
//! - [`runtime`]: the tokio runtime of a shard or worker process, sized by `--io-threads`.
//!
//! Servers and workers both build on this crate; neither depends on the other.

/// Who a certificate says its holder is: [`gaps_common::identity`] (kept here under its old path).
pub use gaps_common::identity;
pub mod net;
pub mod runtime;
pub mod tls;

pub use net::RpcError;
