//! gaps-benches: the `gaps` front door and the measurement code behind it.
//!
//! - [`local`]: `gaps local`, a whole cluster of real processes on loopback.
//! - [`transport`]: `gaps bench transport`.
//! - [`kernels`]: `gaps bench kernels`.

pub mod kernels;
pub mod local;
pub mod transport;
