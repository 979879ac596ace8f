//! The DeepSeek V4 forward pass over a [`Backend`], and the CPU oracle backend.
//!
//! [`forward::forward`] is the only model definition; [`model::Model`] owns weights and the pool
//! of per-sequence states; [`cpu::CpuBackend`] is the f32 reference every backend is checked against.

pub mod backend;
pub mod batch;
pub mod bf16;
pub mod comm;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod diff;
pub mod draw;
pub mod forward;
pub mod model;
pub mod synth;
pub mod x8;

pub use backend::{markov_argmax_ops, Backend, CompSlot, SavedState, SideBranch, StepResult};
pub use batch::{Batch, BatchError, Row, Segment};
pub use cpu::state::{SeqState, StateFormatError, TruncateError, MAX_ROLLBACK};
pub use draw::Draw;
pub use forward::{Capture, Forwarded, Outputs, Probe, Stage};
pub use model::{Model, ModelError, PendingSnapshot, Snapshot, StepOut, StepPath, StepPlan};
