//! gaps-benches: the `gaps` front door and the measurement code behind it.
//!
//! - [`local`]: `gaps local`, a whole cluster of real processes on loopback.
//! - [`transport`]: `gaps bench transport`.
//! - [`kernels`]: `gaps bench kernels`.
//! - [`e2e`]: `gaps bench e2e`.
//! - [`tables`]: `gaps bench tables`.
//! - [`sim`]: `gaps sim`, the deterministic straggler simulator, and its experiments.

pub mod e2e;
pub mod kernels;
pub mod local;
pub mod sim;
pub mod tables;
pub mod transport;
