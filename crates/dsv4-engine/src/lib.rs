//! Sequences, sampling, generation and the continuous-batching engine on top of the forward pass.

pub mod disk_cache;
pub mod engine;
pub mod fingerprint;
pub mod generate;
pub mod metrics;
pub mod prefix_cache;
pub mod sampler;
pub mod sequence;
pub mod speculative;

pub use engine::{scripted, spawn, AdmitError, EngineConfig, EngineHandle, Submission};
pub use generate::{generate, generate_speculative, GenerateError, GenerateOptions, Generation, StopReason};
pub use metrics::Metrics;
pub use prefix_cache::PrefixCacheConfig;
pub use sampler::{SampleError, Sampler, SamplingParams};
pub use sequence::{CancelToken, Event, FinishReason, Request, TokenEvent};
pub use speculative::{DeviceProposer, DeviceRing, DraftJob, Proposer, SpecConfig, SpecPolicy, SpecSeq, SpecStats};
