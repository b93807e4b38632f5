//! gaps-models: the built-in models and their data, shared by the worker, the simulator and `gaps layout`.
//!
//! - [`model`]: the dense logistic regression and the model kinds with their layouts.
//! - [`data`]: its seeded synthetic data.
//! - [`criteo`]: the Criteo-layout reader, the synthetic CTR generator with its planted teacher, AUC.
//! - [`recsys`]: the CTR models (lr, fm, dlrm) and batch indexing.
//!
//! Architecture invariant: no networking and no async runtime; servers never link this crate.

pub mod criteo;
pub mod data;
pub mod model;
pub mod recsys;
