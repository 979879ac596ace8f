//! Sequences, sampling, generation and the continuous-batching engine on top of the forward pass.

pub mod constraint;
pub mod disk_cache;
pub mod engine;
pub mod fingerprint;
pub mod generate;
pub mod logits;
pub mod metrics;
pub mod penalties;
pub mod prefix_cache;
pub mod sampler;
pub mod sequence;
pub mod snapshots;
pub mod speculative;

pub use constraint::{CompiledGrammar, ConstraintError, GrammarEnv, GrammarSpec};
pub use engine::{scripted, spawn, AdmitError, EngineConfig, EngineHandle, Submission};
pub use generate::{generate, generate_speculative, GenerateError, GenerateOptions, Generation, StopReason};
pub use logits::LogitsSpec;
pub use metrics::Metrics;
pub use penalties::PenaltyParams;
pub use prefix_cache::PrefixCacheConfig;
pub use sampler::{SampleError, Sampler, SamplingParams};
pub use sequence::{CancelToken, Event, FinishReason, Request, TokenEvent};
pub use speculative::{DeviceProposer, DeviceRing, DraftJob, Proposer, SpecConfig, SpecPolicy, SpecSeq, SpecStats};
