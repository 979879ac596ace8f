//! Single-sequence generation: prefill in chunks, then decode one token at a time, on the same
//! forward path that batches use.

use crate::sampler::{argmax_margin, SampleError, Sampler};
use crate::speculative::{self, SpecConfig, SpecSeq, SpecStats};
use dsv4_backend::{Backend, Batch, Model, ModelError};

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Sample(#[from] SampleError),
    #[error("empty prompt: at least one token is needed")]
    EmptyPrompt,
    #[error(transparent)]
    Spec(#[from] crate::speculative::SpecError),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    Length,
    Eos,
}

#[derive(Clone, Debug)]
pub struct Generation {
    pub tokens: Vec<u32>,
    /// Top-1 minus top-2 logit at each generated step (how decisive greedy was).
    pub margins: Vec<f32>,
    pub stop: StopReason,
    /// Seconds spent in prefill and in decode.
    pub prefill_secs: f64,
    pub decode_secs: f64,
}

pub struct GenerateOptions<'a> {
    pub max_new_tokens: usize,
    pub stop_ids: &'a [u32],
    /// Longest prefill chunk.
    pub prefill_chunk: usize,
}

/// Generates from `prompt` in a fresh sequence slot, which is freed afterwards.
pub fn generate<B: Backend>(
    model: &mut Model<B>,
    prompt: &[u32],
    sampler: &mut Sampler,
    opts: &GenerateOptions<'_>,
) -> Result<Generation, GenerateError> {
    if prompt.is_empty() {
        return Err(GenerateError::EmptyPrompt);
    }
    let seq = model.alloc_seq()?;
    let result = run(model, seq, prompt, sampler, opts);
    model.free_seq(seq);
    result
}

fn run<B: Backend>(
    model: &mut Model<B>,
    seq: usize,
    prompt: &[u32],
    sampler: &mut Sampler,
    opts: &GenerateOptions<'_>,
) -> Result<Generation, GenerateError> {
    let t0 = std::time::Instant::now();
    let mut logits = Vec::new();
    for (i, chunk) in prompt.chunks(opts.prefill_chunk.max(1)).enumerate() {
        let batch = Batch::chunk(seq, i * opts.prefill_chunk.max(1), chunk).map_err(ModelError::from)?;
        logits = model.forward(&batch, &[chunk.len() - 1])?;
    }
    let prefill_secs = t0.elapsed().as_secs_f64();
    let t1 = std::time::Instant::now();
    let (mut tokens, mut margins) = (Vec::new(), Vec::new());
    let mut stop = StopReason::Length;
    while tokens.len() < opts.max_new_tokens {
        // The uniform of the token's position: the engine draws it the same way, with or
        // without speculation.
        let tok = sampler.sample_at(&logits, prompt.len() + tokens.len())?;
        margins.push(argmax_margin(&logits).1);
        tokens.push(tok);
        if opts.stop_ids.contains(&tok) {
            stop = StopReason::Eos;
            break;
        }
        if tokens.len() == opts.max_new_tokens {
            break;
        }
        let pos = prompt.len() + tokens.len() - 1;
        logits = model.forward(&Batch::chunk(seq, pos, &[tok]).map_err(ModelError::from)?, &[0])?;
    }
    Ok(Generation { tokens, margins, stop, prefill_secs, decode_secs: t1.elapsed().as_secs_f64() })
}

/// [`generate`] with DSpark speculative decoding: prefill with a capture (every prompt row
/// enters the drafter ring), then rounds of draft → one verify forward over
/// `[anchor, d0..d(l-1)]` → accept → `Model::truncate` (no replay) → commit. At temperature 0
/// the tokens equal [`generate`]'s; at temperature > 0 (with `spec.sampled`) they are
/// distributed as its. `margins` are not computed (empty).
pub fn generate_speculative<B: Backend>(
    model: &mut Model<B>,
    prompt: &[u32],
    sampler: &mut Sampler,
    opts: &GenerateOptions<'_>,
    spec: &SpecConfig,
) -> Result<(Generation, SpecStats), GenerateError> {
    if prompt.is_empty() {
        return Err(GenerateError::EmptyPrompt);
    }
    let seq = model.alloc_seq()?;
    let result = run_speculative(model, seq, prompt, sampler, opts, spec);
    model.free_seq(seq);
    result
}

fn run_speculative<B: Backend>(
    model: &mut Model<B>,
    seq: usize,
    prompt: &[u32],
    sampler: &mut Sampler,
    opts: &GenerateOptions<'_>,
    cfg: &SpecConfig,
) -> Result<(Generation, SpecStats), GenerateError> {
    let mut st = SpecSeq::new(cfg, sampler.params.seed);
    let t0 = std::time::Instant::now();
    let logits = speculative::prefill(cfg, &mut st, model, seq, 0, prompt, opts.prefill_chunk)?;
    let prefill_secs = t0.elapsed().as_secs_f64();
    let t1 = std::time::Instant::now();
    let (tokens, stop) = decode_speculative(model, seq, prompt.len(), &logits, &mut st, sampler, opts, cfg)?;
    let gen = Generation { tokens, margins: Vec::new(), stop, prefill_secs, decode_secs: t1.elapsed().as_secs_f64() };
    Ok((gen, st.stats))
}

/// The decode half of [`generate_speculative`]: slot `seq` holds the `prompt_len` prefilled
/// prompt tokens (their captured rows committed to `st`), `logits` are the last prompt row's.
/// Samples the first token from them, then runs speculative rounds up to
/// `opts.max_new_tokens` tokens or a stop id. Tests restore a prefilled snapshot and call this
/// instead of prefilling the prompt again for every sample.
#[allow(clippy::too_many_arguments)]
pub fn decode_speculative<B: Backend>(
    model: &mut Model<B>,
    seq: usize,
    prompt_len: usize,
    logits: &[f32],
    st: &mut SpecSeq,
    sampler: &mut Sampler,
    opts: &GenerateOptions<'_>,
    cfg: &SpecConfig,
) -> Result<(Vec<u32>, StopReason), GenerateError> {
    let mut stop = StopReason::Length;
    let mut tokens = Vec::new();
    if opts.max_new_tokens > 0 {
        tokens.push(sampler.sample(logits)?);
    }
    let max_pos = model.cfg.max_position;
    loop {
        let last = *tokens.last().unwrap_or(&0);
        if tokens.is_empty() || tokens.len() >= opts.max_new_tokens {
            break;
        }
        if opts.stop_ids.contains(&last) {
            stop = StopReason::Eos;
            break;
        }
        let pos = prompt_len + tokens.len() - 1;
        let limit = (opts.max_new_tokens - tokens.len() - 1).min(max_pos.saturating_sub(pos + 1));
        let r = speculative::round(cfg, st, model, seq, last, limit, sampler, opts.stop_ids)?;
        tokens.extend(&r.tokens);
    }
    if tokens.last().is_some_and(|t| opts.stop_ids.contains(t)) {
        stop = StopReason::Eos;
    }
    Ok((tokens, stop))
}
