//! gaps-benches: the measurement code behind `gaps bench` and the bench targets.
//!
//! - [`transport`]: `gaps bench transport`.
//! - [`kernels`]: `gaps bench kernels`.
//! - [`tables`]: `gaps bench tables`.
//! - [`checkpoint`]: `gaps bench checkpoint`.

pub mod checkpoint;
pub mod kernels;
pub mod tables;
pub mod transport;
