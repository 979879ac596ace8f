//! Sequences, sampling and generation on top of the forward pass. (The continuous-batching
//! scheduler grows here.)

pub mod generate;
pub mod sampler;

pub use generate::{generate, GenerateError, GenerateOptions, Generation, StopReason};
pub use sampler::{SampleError, Sampler, SamplingParams};
