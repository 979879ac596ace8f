//! A request as the engine sees it, and the live sequence it becomes.

use crate::sampler::{Sampler, SamplingParams};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// What a client asks the engine for (already tokenised).
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    /// Generation ends after emitting one of these ids (it is included in the output).
    pub stop_ids: Vec<u32>,
    /// Return the sampled token's logprob and this many top alternatives (None: no logprobs).
    pub top_logprobs: Option<usize>,
    /// Prompt positions after which the prefix cache should keep a snapshot.
    pub snapshot_at: Vec<usize>,
    /// Bias, penalties and grammar applied to this request's logits on the host before sampling.
    pub logits: crate::logits::LogitsSpec,
}

impl Request {
    /// `max_tokens` of `prompt`'s continuation under `sampling`, with no stop ids, logprobs,
    /// snapshots or logits processing.
    pub fn new(prompt: Vec<u32>, sampling: SamplingParams, max_tokens: usize) -> Self {
        Self {
            prompt,
            sampling,
            max_tokens,
            stop_ids: Vec::new(),
            top_logprobs: None,
            snapshot_at: Vec::new(),
            logits: Default::default(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was generated.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The client went away or asked to stop.
    Cancelled,
}

/// A generated token with optional log-probabilities.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenEvent {
    pub id: u32,
    pub logprob: Option<f32>,
    pub top: Vec<(u32, f32)>,
}

/// What the engine streams back for one request.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Token(TokenEvent),
    /// `cached_tokens` prompt tokens came from the prefix cache instead of being prefilled.
    Done {
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
        cached_tokens: usize,
    },
    Error(String),
}

/// Lets the API layer stop a sequence (stop strings, disconnects).
#[derive(Clone, Debug, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// A request in flight.
pub struct Sequence {
    pub id: u64,
    pub req: Request,
    pub sampler: Sampler,
    /// Slot in the model's state pool once admitted.
    pub slot: Option<usize>,
    /// Prompt tokens already fed.
    pub prefilled: usize,
    pub generated: Vec<u32>,
    pub events: UnboundedSender<Event>,
    pub cancel: CancelToken,
    pub arrived: Instant,
    pub last_token_at: Option<Instant>,
    /// Prompt tokens restored from the prefix cache.
    pub cached: usize,
    /// DSpark state (drafter ring, statistics) when the engine speculates for this sequence.
    pub spec: Option<crate::speculative::SpecSeq>,
    /// Set to the prompt tokens restored from the prefix cache when the sequence is admitted
    /// (the API layer reports them before the first token).
    pub admitted: Arc<std::sync::OnceLock<usize>>,
    /// The live state of `req.logits` (None when the request needs no row pass).
    pub processor: Option<crate::logits::RowProcessor>,
}

impl Sequence {
    /// Tokens the model state holds once everything scheduled so far has run.
    pub fn len(&self) -> usize {
        self.prefilled + self.generated.len().saturating_sub(1)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn prefill_done(&self) -> bool {
        self.prefilled == self.req.prompt.len()
    }
}
