//! A loaded model on one backend with its pool of sequence states: the unit that prefill,
//! decode, batching and (later) speculative decoding drive.

use crate::backend::Backend;
use crate::batch::{Batch, BatchError};
#[cfg(doc)]
use crate::comm::LocalComm;
use crate::comm::{Comm, Single};
use crate::cpu::state::SeqState;
use crate::draw::Draw;
use crate::forward::{forward_outputs, Capture, Forwarded, Outputs, Probe, RopeTables, Stage};
use dsv4_model::{
    load_weights_with, Checkpoint, Component, Config, HostTensor, LoadError, LoadOptions, MemoryStats, Shard, Weights,
};
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{mpsc, Arc};

/// Recorded step shapes kept at once (decode and verify steps of a deployment use a handful).
const MAX_GRAPHS: usize = 64;
/// Default of [`Model::set_stage_probe_rows`]: eager steps probe the sub-blocks' streams
/// and, when one trips, are cut back and run again with every stage probed. Probing every stage
/// of a 43-layer step is ~860 more launches, which a served step that carries a new prompt
/// (a shape run eagerly) paid on every such step for an error that never comes.
pub const STAGE_PROBE_ROWS: usize = 0;

/// A recorded step's key: rows, output rows, tapped columns, and whether every segment is short
/// ([`crate::batch::SHORT_SEGMENT`]: a backend may pick launches on it).
type StepShape = (usize, usize, usize, bool);

/// One step as the engine plans it: the rows, what comes back, and how many output rows, from
/// the first, bring their logits to the host (sampling with a host pass, logprobs, speculative
/// acceptance). Every output row's token comes back too, chosen on the device by its draw
/// (greedy, or a seeded sample: [`crate::draw`]), so plain rows need no logits: the engine
/// puts the rows that need them first, and only those cross (64 rows of V4's logits are 33
/// MB).
#[derive(Clone, Copy, Debug)]
pub struct StepPlan<'a> {
    pub batch: &'a Batch,
    pub outputs: Outputs<'a>,
    /// Output rows `0..logits` bring their logits (at most `outputs.out_rows.len()`).
    pub logits: usize,
    /// Each output row's draw (an empty slice, or a row past its end: greedy).
    pub draws: &'a [Draw],
}

/// How a step ran, for the engine's counters: the replay of a recorded step, a recording (the
/// forward captured, then replayed), or eager launches (a shape seen for the first time, a
/// step past the recorded sizes, a backend that does not record).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StepPath {
    #[default]
    Eager,
    Recorded,
    Replayed,
}

impl StepPath {
    pub const ALL: [StepPath; 3] = [StepPath::Eager, StepPath::Recorded, StepPath::Replayed];

    pub fn name(self) -> &'static str {
        match self {
            StepPath::Eager => "eager",
            StepPath::Recorded => "recorded",
            StepPath::Replayed => "replayed",
        }
    }
}

/// A step's results on the host.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepOut {
    /// `[plan.logits, vocab]`: the logits of the first `plan.logits` output rows.
    pub logits: Vec<f32>,
    /// The argmax of each output row (first index of the maximum).
    pub ids: Vec<u32>,
    /// `[rows, taps·hidden]`: the tapped layers' stream means of every row (empty: no taps).
    pub hidden: Vec<f32>,
    pub path: StepPath,
}

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
    #[error("tapped layers {taps:?} must be ascending and below the model's {layers} layers")]
    Taps { taps: Vec<usize>, layers: usize },
    #[error("rollback failed: {0}")]
    Truncate(String),
    /// A rank of a group on a backend whose MoE op indexes every expert.
    #[error("the {0} backend cannot hold a share of the routed experts (expert parallelism); run it on one rank")]
    NoExpertParallel(&'static str),
    /// The weights would not fit the device (checked before anything is allocated).
    #[error(
        "the model does not fit: it needs {} of weights ({}), plus {} for activations, but only {} is free",
        gib(need.iter().sum()),
        need_parts(need),
        gib(*margin),
        gib(*free)
    )]
    DoesNotFit { need: [u64; 4], free: u64, margin: u64 },
    /// A stage of the forward produced a NaN or ±∞ (the first such stage in forward order).
    #[error("nonfinite value in {} (batch row {row})", stage_name(*.layer, .stage))]
    NonFinite {
        layer: Option<usize>,
        stage: &'static str,
        /// The first batch row holding one (for the head stages: the batch row of that output row).
        row: usize,
    },
}

fn gib(b: u64) -> String {
    let b = b as f64;
    match b {
        b if b >= (1u64 << 30) as f64 => format!("{:.2} GiB", b / (1u64 << 30) as f64),
        b if b >= (1u64 << 20) as f64 => format!("{:.1} MiB", b / (1u64 << 20) as f64),
        b => format!("{:.1} KiB", b / 1024.0),
    }
}

fn need_parts(need: &[u64; 4]) -> String {
    Component::ALL.iter().zip(need).map(|(c, b)| format!("{} {}", c.label(), gib(*b))).collect::<Vec<_>>().join(", ")
}

/// What a model may use: the backend's free memory, capped by `DSV4_MEMORY_LIMIT_GB` (also
/// for backends that do not know their free memory, e.g. to keep a host model within bounds).
fn memory_budget(free: Option<u64>) -> Option<u64> {
    let limit = std::env::var("DSV4_MEMORY_LIMIT_GB").ok().and_then(|v| v.trim().parse::<f64>().ok());
    let limit = limit.filter(|g| *g >= 0.0).map(|g| (g * 1e9) as u64);
    match (free, limit) {
        (Some(f), Some(l)) => Some(f.min(l)),
        (f, l) => f.or(l),
    }
}

/// Device bytes per [`Component`] that loading `shard`'s share of `ck` onto `backend` would
/// allocate, from a dry run of the loader (no tensor data is read).
pub fn resident_plan<B: Backend>(
    backend: &B,
    ck: &Checkpoint,
    cfg: &Config,
    shard: Shard,
) -> Result<[u64; 4], LoadError> {
    let mut need = [0u64; 4];
    let opts = LoadOptions { keep_packed: backend.keeps_packed(), dry: true, shard };
    load_weights_with(ck.source(), cfg, opts, false, |t| {
        let i = Component::ALL.iter().position(|&c| c == Component::of(&t.name)).unwrap();
        need[i] += backend.resident_bytes(&t);
        Ok(())
    })?;
    Ok(need)
}

fn stage_name(layer: Option<usize>, name: &'static str) -> String {
    Stage { layer, name }.to_string()
}

impl ModelError {
    /// The stage named by a [`ModelError::NonFinite`] (`layers.3.attn.kv`).
    pub fn stage(&self) -> Option<Stage> {
        match self {
            ModelError::NonFinite { layer, stage, .. } => Some(Stage { layer: *layer, name: stage }),
            _ => None,
        }
    }
}

/// A sequence's state after `len` tokens (spec §9.1: window ring, compressed entries,
/// compressor open and overlap rows, indexer state), held on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    pub len: usize,
    pub state: SeqState,
}

/// A snapshot whose state may still be on its way from the device ([`Model::snapshot_deferred`]).
pub struct PendingSnapshot {
    pub len: usize,
    pub state: crate::SavedState,
}

impl PendingSnapshot {
    /// Whether the state is already on the host (no copy to wait for).
    pub fn is_ready(&self) -> bool {
        matches!(self.state, crate::SavedState::Ready(_))
    }

    /// The snapshot, waiting for its copy if one is in flight.
    pub fn wait(self) -> Snapshot {
        Snapshot { len: self.len, state: self.state.wait() }
    }
}

pub struct Model<B: Backend> {
    pub backend: B,
    /// The model's configuration (global, whatever share this rank holds).
    pub cfg: Config,
    /// This rank's share of the weights (all of them on a single rank).
    pub weights: Weights<B::W>,
    /// What the forward runs with: [`Shard::local_config`] of `cfg` (`cfg` on a single rank).
    local_cfg: Config,
    comm: Box<dyn Comm<B>>,
    rope: RopeTables,
    cache: B::Cache,
    /// Tokens held by each allocated sequence slot.
    seqs: Vec<Option<usize>>,
    /// Recorded steps by key `(rows, output rows, tapped columns, short segments)`, with the
    /// generation (the cache's and the backend's settings) each was recorded under.
    graphs: HashMap<StepShape, Recorded<B::Graph>>,
    /// Steps run, the clock of [`Recorded::used`].
    ticks: u64,
    /// Shapes run once: a shape is recorded the second time it comes (one-off shapes, such as
    /// a short prompt's only chunk, stay eager; the first run also fills the backend's tables).
    seen: HashSet<StepShape>,
    /// Whether steps the backend can record are recorded and replayed (`DSV4_GRAPHS=0`: never).
    graphs_on: bool,
    /// Eager steps of more rows than this probe only the sub-blocks' streams
    /// ([`Probe::Layers`]); see [`Self::set_stage_probe_rows`].
    stage_probe_rows: usize,
    /// Ranks 1.. of an in-process group that this model (rank 0) drives, one worker thread
    /// each: every state change and forward is run on them too, so callers (the engine) see
    /// one model. Empty on a single rank and on the ranks themselves.
    peers: Vec<mpsc::Sender<Job<B>>>,
}

/// A recorded step and what decides whether it is still good and which one goes first.
struct Recorded<G> {
    /// The generation (the cache's and the backend's settings) it was recorded under.
    generation: u64,
    graph: G,
    /// The step ([`Model::ticks`]) that last replayed it: the least recently used is dropped
    /// when [`MAX_GRAPHS`] are held, so one-off shapes never push out the decode steps.
    used: u64,
}

/// Work sent to a rank's worker thread.
type Job<B> = Box<dyn FnOnce(&mut Model<B>) + Send>;

impl<B: Backend> Model<B> {
    /// Loads `dir` (config.json + safetensors; or a GGUF written by `dsv4 quantize`, given as the
    /// `.gguf` file or a directory holding one and no config.json) onto `backend` with room for
    /// `max_seqs` sequences. Logs the bytes of each component.
    pub fn load(backend: B, dir: &Path, max_seqs: usize, progress: bool) -> Result<Self, ModelError> {
        Self::load_with(backend, dir, max_seqs, progress, |_| {})
    }

    /// [`Model::load`] with `edit` applied to every tensor before upload (tests: planting a NaN,
    /// rounding to bf16 with [`crate::bf16::round_weight`]).
    pub fn load_with(
        backend: B,
        dir: &Path,
        max_seqs: usize,
        progress: bool,
        edit: impl FnMut(&mut HostTensor),
    ) -> Result<Self, ModelError> {
        Self::load_rank(backend, dir, max_seqs, progress, edit, Box::new(Single))
    }

    /// Loads rank `comm.rank()`'s share of `dir` (see [`Shard`]): routed experts it does not
    /// own are never read, and the memory check counts only what this rank's device holds.
    /// Every rank of the group loads its own share the same way (e.g. one thread each).
    pub fn load_rank(
        backend: B,
        dir: &Path,
        max_seqs: usize,
        progress: bool,
        mut edit: impl FnMut(&mut HostTensor),
        comm: Box<dyn Comm<B>>,
    ) -> Result<Self, ModelError> {
        let shard = Shard::new(comm.rank(), comm.world());
        if !shard.is_whole() && !backend.expert_parallel() {
            // Refused before reading anything (`with_comm` checks again).
            return Err(ModelError::NoExpertParallel(backend.name()));
        }
        let (cfg, ck) = Checkpoint::open(dir)?;
        shard.check(&cfg)?;
        let keep_packed = backend.keeps_packed();
        if let Some(free) = memory_budget(backend.memory_free()) {
            let need = resident_plan(&backend, &ck, &cfg, shard)?;
            let total: u64 = need.iter().sum();
            // Room for the activations and workspaces of a forward beside the weights.
            let margin = (2u64 << 30).min(free / 8);
            if total + margin > free {
                return Err(ModelError::DoesNotFit { need, free, margin });
            }
        }
        let opts = LoadOptions { keep_packed, dry: false, shard };
        let (weights, stats): (_, MemoryStats) = load_weights_with(ck.source(), &cfg, opts, progress, |mut t| {
            edit(&mut t);
            backend.upload(t)
        })?;
        if !shard.is_whole() {
            tracing::info!("rank {} of {}", shard.rank, shard.world);
        }
        tracing::info!("loaded {}: {}", dir.display(), stats.summary());
        Self::with_comm(backend, cfg, weights, max_seqs, comm)
    }

    pub fn new(backend: B, cfg: Config, weights: Weights<B::W>, max_seqs: usize) -> Self {
        Self::with_comm(backend, cfg, weights, max_seqs, Box::new(Single))
            .expect("one rank needs no expert parallelism")
    }

    /// A rank of a group: `weights` are its share (loaded with [`LoadOptions::shard`] of
    /// `comm`'s rank), `cfg` the global configuration. A world above one needs a backend whose
    /// MoE op takes a share of the experts ([`Backend::expert_parallel`]).
    pub fn with_comm(
        backend: B,
        cfg: Config,
        weights: Weights<B::W>,
        max_seqs: usize,
        comm: Box<dyn Comm<B>>,
    ) -> Result<Self, ModelError> {
        if comm.world() > 1 && !backend.expert_parallel() {
            return Err(ModelError::NoExpertParallel(backend.name()));
        }
        let local_cfg = Shard::new(comm.rank(), comm.world()).local_config(&cfg);
        let cache = backend.new_cache(&local_cfg, max_seqs);
        // A collective that round-trips through the host cannot be recorded into a step graph.
        let graphs_on = comm.recordable() && std::env::var("DSV4_GRAPHS").map_or(true, |v| v.trim() != "0");
        Ok(Model {
            rope: RopeTables::new(&cfg),
            backend,
            cfg,
            local_cfg,
            comm,
            weights,
            cache,
            seqs: vec![None; max_seqs],
            graphs: HashMap::new(),
            ticks: 0,
            seen: HashSet::new(),
            graphs_on,
            stage_probe_rows: STAGE_PROBE_ROWS,
            peers: Vec::new(),
        })
    }

    /// Loads an in-process group of `backends.len()` ranks (rank `r` on `backends[r]` with
    /// `comms[r]`, e.g. [`LocalComm::boxed`] or the CUDA backend's NCCL communicators; each
    /// loads only its share, in parallel) and returns rank 0 driving the others (see
    /// [`Model::from_ranks`]).
    pub fn load_group(
        backends: Vec<B>,
        comms: Vec<Box<dyn Comm<B>>>,
        dir: &Path,
        max_seqs: usize,
        progress: bool,
    ) -> Result<Self, ModelError>
    where
        B: 'static,
        Model<B>: Send,
    {
        assert_eq!(backends.len(), comms.len(), "one communicator per rank");
        let ranks = std::thread::scope(|s| {
            let hs: Vec<_> = backends
                .into_iter()
                .zip(comms)
                .enumerate()
                .map(|(r, (b, c))| s.spawn(move || Model::load_rank(b, dir, max_seqs, progress && r == 0, |_| {}, c)))
                .collect();
            hs.into_iter().map(|h| h.join().expect("a rank panicked while loading")).collect::<Vec<_>>()
        });
        Ok(Self::from_ranks(ranks.into_iter().collect::<Result<_, _>>()?))
    }

    /// Rank 0 of `ranks` (rank `r` at index `r`, all joined by one communicator), driving the
    /// others from a worker thread each: every call that changes sequence state, and every
    /// forward, runs on all ranks (the others concurrently with rank 0, meeting it in the
    /// collectives), so the result is used like a single model. A rank that panics leaves the
    /// others waiting in a collective.
    pub fn from_ranks(ranks: Vec<Model<B>>) -> Self
    where
        B: 'static,
        Model<B>: Send,
    {
        let mut it = ranks.into_iter();
        let mut first = it.next().expect("a group needs rank 0");
        assert_eq!((first.comm.rank(), first.peers.len()), (0, 0), "rank 0 first, and not a group already");
        for (r, mut m) in it.enumerate() {
            assert_eq!(m.comm.rank(), r + 1, "ranks in order");
            let (tx, rx) = mpsc::channel::<Job<B>>();
            std::thread::Builder::new()
                .name(format!("dsv4-rank{}", r + 1))
                .spawn(move || {
                    while let Ok(job) = rx.recv() {
                        job(&mut m);
                    }
                })
                .expect("spawning a rank's worker thread");
            first.peers.push(tx);
        }
        first
    }

    /// How many ranks this model's forward spans (1 on a single device).
    pub fn world(&self) -> usize {
        self.comm.world()
    }

    /// Starts `f` on every peer rank; their results arrive in rank order on the receivers.
    fn on_peers<R: Send + 'static>(
        &self,
        f: impl Fn(&mut Model<B>) -> R + Send + Sync + 'static,
    ) -> Vec<mpsc::Receiver<R>> {
        let f = Arc::new(f);
        self.peers
            .iter()
            .map(|p| {
                let (tx, rx) = mpsc::channel();
                let f = f.clone();
                p.send(Box::new(move |m: &mut Model<B>| {
                    let _ = tx.send(f(m));
                }))
                .expect("a rank's worker thread has stopped");
                rx
            })
            .collect()
    }

    fn from_peers<R>(rx: Vec<mpsc::Receiver<R>>) -> Vec<R> {
        rx.into_iter().map(|r| r.recv().expect("a rank's worker thread panicked")).collect()
    }

    /// Turns recorded steps (CUDA graphs) on or off; on by default where the backend records.
    /// Eager steps of up to `rows` rows probe every named stage for nonfinite values; longer
    /// ones (prefill chunks) probe the embedding, each sub-block's residual streams and the
    /// logits, and when one of those trips, the step is cut back and run again with every stage
    /// probed (where the state can be cut back that far; else the error names the sub-block).
    pub fn set_stage_probe_rows(&mut self, rows: usize) {
        let peers = self.on_peers(move |m| m.set_stage_probe_rows(rows));
        self.stage_probe_rows = rows;
        Self::from_peers(peers);
    }

    pub fn set_graphs(&mut self, on: bool) {
        let peers = self.on_peers(move |m| m.set_graphs(on));
        self.graphs_on = on && self.comm.recordable();
        if !on {
            self.graphs.clear();
        }
        Self::from_peers(peers);
    }

    /// How many step shapes are recorded now.
    pub fn recorded_steps(&self) -> usize {
        self.graphs.len()
    }

    /// Hands a host vector a step returned (its logits) back to the backend once used, so the
    /// next step's download reuses its pages ([`Backend::recycle_host`]).
    pub fn recycle(&self, v: Vec<f32>) {
        self.backend.recycle_host(v);
    }

    /// The kernel launches of the recorded step of `rows` rows and `out` output rows (no
    /// taps), if one is recorded and the backend counts them: the step whose segments are all
    /// short (decode and verify) where both kinds are recorded.
    pub fn recorded_kernels(&self, rows: usize, out: usize) -> Option<usize> {
        let r = self.graphs.get(&(rows, out, 0, true)).or_else(|| self.graphs.get(&(rows, out, 0, false)))?;
        Some(self.backend.graph_kernels(&r.graph)).filter(|&k| k > 0)
    }

    /// Takes a free sequence slot with fresh (reset) state.
    pub fn alloc_seq(&mut self) -> Result<usize, ModelError> {
        let peers = self.on_peers(|m| m.alloc_seq().ok());
        let s = self.seqs.iter().position(Option::is_none).ok_or(ModelError::PoolFull(self.seqs.len()));
        for p in Self::from_peers(peers) {
            assert_eq!(p, s.as_ref().ok().copied(), "ranks disagree on the free sequence slot");
        }
        let s = s?;
        self.backend.reset_seq(&mut self.cache, s);
        self.seqs[s] = Some(0);
        Ok(s)
    }

    pub fn free_seq(&mut self, seq: usize) {
        Self::from_peers(self.on_peers(move |m| m.free_seq(seq)));
        if let Some(s) = self.seqs.get_mut(seq) {
            *s = None;
        }
    }

    /// The least free memory of any rank (`None` where the backend does not know it): what
    /// the states and a step's activations, which every rank holds in full, may take.
    pub fn memory_free(&self) -> Option<u64> {
        let peers = Self::from_peers(self.on_peers(|m| m.backend.memory_free()));
        peers.into_iter().fold(self.backend.memory_free(), |a, p| match (a, p) {
            (Some(a), Some(p)) => Some(a.min(p)),
            _ => None,
        })
    }

    /// Reserves every slot's state for `tokens` positions, on every rank (see
    /// [`Backend::reserve_state`]): `serve` does so for its context limit before the first step.
    pub fn reserve_state(&mut self, tokens: usize) {
        Self::from_peers(self.on_peers(move |m| m.reserve_state(tokens)));
        self.backend.reserve_state(&mut self.cache, tokens);
    }

    pub fn seq_len(&self, seq: usize) -> Option<usize> {
        self.seqs.get(seq).copied().flatten()
    }

    /// The backend and the state of every sequence slot (backend-specific tuning, reservations);
    /// rank 0's only in a group.
    pub fn backend_and_cache(&mut self) -> (&B, &mut B::Cache) {
        (&self.backend, &mut self.cache)
    }

    pub fn cache(&self) -> &B::Cache {
        &self.cache
    }

    /// The sequence's whole state and length, on the host; `None` if the backend cannot save.
    pub fn snapshot(&self, seq: usize) -> Option<Snapshot> {
        let len = self.seq_len(seq)?;
        self.backend.save_seq(&self.cache, &self.local_cfg, seq, len).map(|state| Snapshot { len, state })
    }

    /// [`Model::snapshot`] without waiting for a device copy: the state as of the work queued
    /// so far (what the last step left), to be finished with [`PendingSnapshot::wait`], on
    /// any thread, while the next steps run.
    pub fn snapshot_deferred(&self, seq: usize) -> Option<PendingSnapshot> {
        let len = self.seq_len(seq)?;
        self.backend
            .save_seq_deferred(&self.cache, &self.local_cfg, seq, len)
            .map(|state| PendingSnapshot { len, state })
    }

    /// Cuts the sequence back to its first `len` tokens without replaying anything (rejected
    /// speculative tokens): window rows, compressed entries, compressor open and overlap rows
    /// and the indexer state all return to what a plain run to `len` holds.
    pub fn truncate(&mut self, seq: usize, len: usize) -> Result<(), ModelError> {
        let peers = self.on_peers(move |m| m.truncate(seq, len));
        let r = self.truncate_here(seq, len);
        Self::from_peers(peers).into_iter().fold(r, |a, p| a.and(p))
    }

    fn truncate_here(&mut self, seq: usize, len: usize) -> Result<(), ModelError> {
        let have = self.seq_len(seq).ok_or(BatchError::NoSequence { seq })?;
        self.backend.truncate_seq(&mut self.cache, seq, have, len).map_err(ModelError::Truncate)?;
        self.seqs[seq] = Some(len);
        Ok(())
    }

    /// Puts a snapshot into an allocated slot: the sequence continues exactly as if it had
    /// prefilled the snapshot's tokens itself. `false` if the backend cannot restore.
    pub fn restore(&mut self, seq: usize, snap: &Snapshot) -> bool {
        let peers = if self.peers.is_empty() {
            Vec::new()
        } else {
            let shared = Arc::new(snap.clone());
            self.on_peers(move |m| m.restore(seq, &shared))
        };
        let ok = self.restore_here(seq, snap);
        Self::from_peers(peers).into_iter().all(|p| p == ok) && ok
    }

    fn restore_here(&mut self, seq: usize, snap: &Snapshot) -> bool {
        if self.seq_len(seq).is_none()
            || !self.backend.load_seq(&mut self.cache, &self.local_cfg, seq, &snap.state, snap.len)
        {
            return false;
        }
        self.seqs[seq] = Some(snap.len);
        true
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

    /// Runs `batch`, returning the logits of `out_rows` (`[out_rows.len(), vocab]`) on the host.
    ///
    /// Every named stage is checked for nonfinite values (one synchronisation at the end, no
    /// stage); the first one found fails the call with [`ModelError::NonFinite`]. The sequences'
    /// states have then advanced over the batch and should be freed.
    pub fn forward(&mut self, batch: &Batch, out_rows: &[usize]) -> Result<Vec<f32>, ModelError> {
        self.forward_with(batch, out_rows, None)
    }

    /// [`Model::forward`] handing every named intermediate to `cap` (an eager, fully probed
    /// forward); without a capture, [`Model::step`].
    pub fn forward_with(
        &mut self,
        batch: &Batch,
        out_rows: &[usize],
        cap: Option<&mut dyn Capture<B>>,
    ) -> Result<Vec<f32>, ModelError> {
        let plan = StepPlan { batch, outputs: Outputs { out_rows, taps: &[] }, logits: out_rows.len(), draws: &[] };
        match cap {
            None => self.step(&plan).map(|o| o.logits),
            Some(c) => {
                // The peers run the same forward (without the capture) concurrently; every rank
                // ends with the same logits, so rank 0's are returned, or the first error of any.
                let peers = self.step_on_peers(&plan);
                let r = self.check(batch).map_err(ModelError::from).and_then(|()| self.forward_eager(&plan, Some(c)));
                Self::from_peers(peers).into_iter().fold(r, |a, p| p.and(a)).map(|o| o.logits)
            }
        }
    }

    /// Runs one step. Steps of up to [`Backend::graph_max_rows`] rows are recorded once per
    /// shape and replayed (the same kernels on the same inputs: bitwise the eager result);
    /// their logits are checked for nonfinite values, and when one is found the step is cut
    /// back and run again with every stage probed, so the error still names the first stage.
    /// Longer steps run eagerly with every stage probed.
    ///
    /// On a group of ranks, the other ranks run the same step concurrently (each returns the
    /// same results; rank 0's are returned, or the first error of any rank).
    pub fn step(&mut self, plan: &StepPlan<'_>) -> Result<StepOut, ModelError> {
        let peers = self.step_on_peers(plan);
        let r = self.step_here(plan);
        Self::from_peers(peers).into_iter().fold(r, |a, p| p.and(a))
    }

    /// Hands `plan` to every other rank of the group (none: nothing to wait for).
    fn step_on_peers(&self, plan: &StepPlan<'_>) -> Vec<mpsc::Receiver<Result<(), ModelError>>> {
        if self.peers.is_empty() {
            return Vec::new();
        }
        let (b, o, t, logits, d) = (
            plan.batch.clone(),
            plan.outputs.out_rows.to_vec(),
            plan.outputs.taps.to_vec(),
            plan.logits,
            plan.draws.to_vec(),
        );
        self.on_peers(move |m| {
            let plan = StepPlan { batch: &b, outputs: Outputs { out_rows: &o, taps: &t }, logits, draws: &d };
            m.step_here(&plan).map(|_| ())
        })
    }

    fn step_here(&mut self, plan: &StepPlan<'_>) -> Result<StepOut, ModelError> {
        self.check(plan.batch)?;
        let taps = plan.outputs.taps;
        if taps.windows(2).any(|w| w[0] >= w[1]) || taps.last().is_some_and(|&l| l >= self.cfg.layers.len()) {
            return Err(ModelError::Taps { taps: taps.to_vec(), layers: self.cfg.layers.len() });
        }
        let (batch, out_rows) = (plan.batch, plan.outputs.out_rows);
        if self.graphs_on && !out_rows.is_empty() && batch.len() <= self.backend.graph_max_rows(&self.local_cfg) {
            return self.step_recorded(plan);
        }
        self.forward_eager(plan, None)
    }

    fn step_recorded(&mut self, plan: &StepPlan<'_>) -> Result<StepOut, ModelError> {
        let (batch, out_rows) = (plan.batch, plan.outputs.out_rows);
        let hidden_cols = plan.outputs.taps.len() * self.cfg.hidden;
        let key = (batch.len(), out_rows.len(), hidden_cols, batch.short_segments());
        if !self.graphs.contains_key(&key) && self.seen.insert(key) {
            return self.forward_eager(plan, None);
        }
        let generation =
            self.backend.prepare_step(&mut self.cache, batch, out_rows, plan.draws, self.cfg.vocab_size, hidden_cols);
        self.ticks += 1;
        let mut path = StepPath::Replayed;
        if self.graphs.get(&key).map(|r| r.generation) != Some(generation) {
            self.graphs.remove(&key);
            if self.graphs.len() >= MAX_GRAPHS {
                let old = *self.graphs.iter().min_by_key(|(_, r)| r.used).expect("a recorded step").0;
                self.graphs.remove(&old);
            }
            if !self.backend.begin_record(key.0, key.1, key.2) {
                return self.forward_eager(plan, None);
            }
            let f = self.run(plan, None, Probe::Off);
            match self.backend.end_record(f.logits, f.hidden) {
                Ok(graph) => {
                    self.graphs.insert(key, Recorded { generation, graph, used: 0 });
                    path = StepPath::Recorded;
                }
                Err(e) => {
                    // Nothing ran while recording: the step runs eagerly, and so do later ones.
                    tracing::warn!("recording a step of {} rows failed ({e}); running steps eagerly", key.0);
                    self.set_graphs(false);
                    return self.forward_eager(plan, None);
                }
            }
        }
        let r = self.graphs.get_mut(&key).expect("recorded above");
        r.used = self.ticks;
        let g = &r.graph;
        self.backend.replay(g);
        for s in &batch.segments {
            self.seqs[s.seq] = Some(s.pos0 + s.len);
        }
        let r = self.backend.step_output(g, plan.logits.min(out_rows.len()));
        match r.nonfinite {
            None => Ok(StepOut { logits: r.logits, ids: r.ids, hidden: r.hidden, path }),
            Some(row) => Err(self.locate_nonfinite(plan, row)),
        }
    }

    /// A replayed step's logits held a nonfinite value in output row `row`: cut the step back
    /// and run it again with every stage probed, for the error that names the first stage.
    fn locate_nonfinite(&mut self, plan: &StepPlan<'_>, row: usize) -> ModelError {
        let out_rows = plan.outputs.out_rows;
        let fallback =
            ModelError::NonFinite { layer: None, stage: "logits", row: out_rows.get(row).copied().unwrap_or(row) };
        if self.comm.world() > 1 {
            // Each rank finds the nonfinite logits on its own; re-running eagerly here would
            // call collectives the other ranks do not.
            return fallback;
        }
        if plan.batch.segments.iter().any(|s| self.cut_back(s.seq, s.pos0).is_err()) {
            return fallback;
        }
        match self.forward_eager(plan, None) {
            Err(e) => e,
            Ok(_) => fallback,
        }
    }

    /// The forward of `plan` on this rank's weights and states, `probe` choosing the probed stages.
    fn run(&mut self, plan: &StepPlan<'_>, cap: Option<&mut dyn Capture<B>>, probe: Probe) -> Forwarded<B::T> {
        let (b, cfg, w, comm) = (&self.backend, &self.local_cfg, &self.weights, self.comm.as_ref());
        forward_outputs(b, cfg, w, &self.rope, &mut self.cache, plan.batch, plan.outputs, cap, comm, probe)
    }

    fn forward_eager(&mut self, plan: &StepPlan<'_>, cap: Option<&mut dyn Capture<B>>) -> Result<StepOut, ModelError> {
        let (batch, out_rows) = (plan.batch, plan.outputs.out_rows);
        let probe = if cap.is_none() && batch.len() > self.stage_probe_rows { Probe::Layers } else { Probe::Stages };
        let f = self.run(plan, cap, probe);
        for s in &batch.segments {
            self.seqs[s.seq] = Some(s.pos0 + s.len);
        }
        if let Some(coarse) = self.first_nonfinite(&f, out_rows) {
            // Cut back and run again with every stage probed, for the first stage's name (on
            // one rank: the others would not join the rerun's collectives).
            if probe == Probe::Layers
                && self.comm.world() == 1
                && batch.segments.iter().all(|s| self.cut_back(s.seq, s.pos0).is_ok())
            {
                let f = self.run(plan, None, Probe::Stages);
                for s in &batch.segments {
                    self.seqs[s.seq] = Some(s.pos0 + s.len);
                }
                if let Some(e) = self.first_nonfinite(&f, out_rows) {
                    return Err(e);
                }
            }
            return Err(coarse);
        }
        let ids = if out_rows.is_empty() { Vec::new() } else { self.backend.draw_rows(&f.logits, plan.draws) };
        let n = plan.logits.min(out_rows.len());
        let logits = if n > 0 { self.backend.to_host_rows(&f.logits, n) } else { Vec::new() };
        let hidden = f.hidden.map(|h| self.backend.to_host(&h)).unwrap_or_default();
        Ok(StepOut { logits, ids, hidden, path: StepPath::Eager })
    }

    /// Undoes a failed step's rows of `seq` from `pos0` on, before the probed rerun (one rank):
    /// a reset where the segment began the sequence (a prompt's first chunk of any length),
    /// else a truncation, which reaches back [`crate::MAX_ROLLBACK`] tokens.
    fn cut_back(&mut self, seq: usize, pos0: usize) -> Result<(), ModelError> {
        if pos0 > 0 {
            return self.truncate_here(seq, pos0);
        }
        self.backend.reset_seq(&mut self.cache, seq);
        self.seqs[seq] = Some(0);
        Ok(())
    }

    /// The first probed stage of `f` that held a nonfinite value, as the error that names it.
    fn first_nonfinite(&self, f: &Forwarded<B::T>, out_rows: &[usize]) -> Option<ModelError> {
        let probes = self.backend.read_probes(&self.cache, f.stages.len());
        let (i, row) = probes.iter().enumerate().find_map(|(i, p)| p.map(|r| (i, r)))?;
        let st = f.stages[i];
        let head = st.layer.is_none() && st.name != "embed";
        let row = if head { out_rows.get(row).copied().unwrap_or(row) } else { row };
        Some(ModelError::NonFinite { layer: st.layer, stage: st.name, row })
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
