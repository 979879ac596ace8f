//! A loaded model on one backend with its pool of sequence states: the unit that prefill,
//! decode, batching and (later) speculative decoding drive.

use crate::backend::Backend;
use crate::batch::{Batch, BatchError};
use crate::forward::{forward, Capture, RopeTables};
use dsv4_model::{load_weights, Config, LoadError, TensorStore, Weights};
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Batch(#[from] BatchError),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("all {0} sequence slots are in use")]
    PoolFull(usize),
    #[error("chunk sizes {chunks:?} sum to {sum}, but there are {tokens} tokens")]
    Chunks { chunks: Vec<usize>, sum: usize, tokens: usize },
    #[error("a chunk size of 0 is not allowed")]
    EmptyChunk,
}

pub struct Model<B: Backend> {
    pub backend: B,
    pub cfg: Config,
    pub weights: Weights<B::W>,
    rope: RopeTables,
    cache: B::Cache,
    /// Tokens held by each allocated sequence slot.
    seqs: Vec<Option<usize>>,
}

impl<B: Backend> Model<B> {
    /// Loads `dir` (config.json + safetensors) onto `backend` with room for `max_seqs` sequences.
    pub fn load(backend: B, dir: &Path, max_seqs: usize, progress: bool) -> Result<Self, ModelError> {
        let cfg = Config::from_dir(dir).map_err(LoadError::from)?;
        let store = TensorStore::open(dir)?;
        let weights = load_weights(&store, &cfg, progress, |t| backend.upload(t))?;
        Ok(Self::new(backend, cfg, weights, max_seqs))
    }

    pub fn new(backend: B, cfg: Config, weights: Weights<B::W>, max_seqs: usize) -> Self {
        let cache = backend.new_cache(&cfg, max_seqs);
        Model { rope: RopeTables::new(&cfg), backend, cfg, weights, cache, seqs: vec![None; max_seqs] }
    }

    /// Takes a free sequence slot with fresh (reset) state.
    pub fn alloc_seq(&mut self) -> Result<usize, ModelError> {
        let s = self.seqs.iter().position(Option::is_none).ok_or(ModelError::PoolFull(self.seqs.len()))?;
        self.backend.reset_seq(&mut self.cache, s);
        self.seqs[s] = Some(0);
        Ok(s)
    }

    pub fn free_seq(&mut self, seq: usize) {
        if let Some(s) = self.seqs.get_mut(seq) {
            *s = None;
        }
    }

    pub fn seq_len(&self, seq: usize) -> Option<usize> {
        self.seqs.get(seq).copied().flatten()
    }

    pub fn cache(&self) -> &B::Cache {
        &self.cache
    }

    /// Checks the batch against the sequences it continues.
    fn check(&self, batch: &Batch) -> Result<(), BatchError> {
        for (i, r) in batch.rows.iter().enumerate() {
            if r.token as usize >= self.cfg.vocab_size {
                return Err(BatchError::Token { row: i, token: r.token, vocab: self.cfg.vocab_size });
            }
        }
        for s in &batch.segments {
            let len = self.seq_len(s.seq).ok_or(BatchError::NoSequence { seq: s.seq })?;
            if s.pos0 != len {
                return Err(BatchError::Position { seq: s.seq, expected: len, found: s.pos0 });
            }
            let last = s.pos0 + s.len - 1;
            if last >= self.cfg.max_position {
                return Err(BatchError::TooLong { seq: s.seq, pos: last, max: self.cfg.max_position });
            }
        }
        Ok(())
    }

    /// Runs a batch and returns the logits of `out_rows` as `[out_rows.len() × vocab]` on the host.
    pub fn forward(&mut self, batch: &Batch, out_rows: &[usize]) -> Result<Vec<f32>, ModelError> {
        self.forward_with(batch, out_rows, None)
    }

    pub fn forward_with(
        &mut self,
        batch: &Batch,
        out_rows: &[usize],
        cap: Option<&mut dyn Capture<B>>,
    ) -> Result<Vec<f32>, ModelError> {
        self.check(batch)?;
        let logits =
            forward(&self.backend, &self.cfg, &self.weights, &self.rope, &mut self.cache, batch, out_rows, cap);
        for s in &batch.segments {
            self.seqs[s.seq] = Some(s.pos0 + s.len);
        }
        Ok(self.backend.to_host(&logits))
    }

    /// Feeds `tokens` to `seq` in the given chunks and returns the logits at every position
    /// (`[tokens.len() × vocab]`). Chunks must sum to the token count.
    pub fn prefill_chunks(&mut self, seq: usize, tokens: &[u32], chunks: &[usize]) -> Result<Vec<f32>, ModelError> {
        let sum: usize = chunks.iter().sum();
        if sum != tokens.len() {
            return Err(ModelError::Chunks { chunks: chunks.to_vec(), sum, tokens: tokens.len() });
        }
        if chunks.contains(&0) {
            return Err(ModelError::EmptyChunk);
        }
        let mut out = Vec::with_capacity(tokens.len() * self.cfg.vocab_size);
        let mut off = 0;
        for &n in chunks {
            let pos0 = self.seq_len(seq).ok_or(BatchError::NoSequence { seq })?;
            let batch = Batch::chunk(seq, pos0, &tokens[off..off + n])?;
            let all: Vec<usize> = (0..n).collect();
            out.extend(self.forward(&batch, &all)?);
            off += n;
        }
        Ok(out)
    }
}
