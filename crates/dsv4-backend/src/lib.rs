//! The DeepSeek V4 forward pass over a [`Backend`], and the CPU oracle backend.
//!
//! [`forward::forward`] is the only model definition; [`model::Model`] owns weights and the pool
//! of per-sequence states; [`cpu::CpuBackend`] is the f32 reference every backend is checked against.

pub mod backend;
pub mod batch;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod forward;
pub mod model;

pub use backend::{Backend, CompSlot};
pub use batch::{Batch, BatchError, Row, Segment};
pub use forward::{Capture, Stage};
pub use model::{Model, ModelError};
