//! gaps-worker: the client library (registration, routing, concurrent push/pull with exactly-once retries)
//! and the training loop of the built-in models.

pub mod client;
pub mod feed;
pub mod train;

pub use client::{Client, ClientError, ClientOptions, PushSummary, Snapshot, StepOutcome};
pub use gaps_models::{criteo, data, model, recsys};
pub use gaps_transport::net;
