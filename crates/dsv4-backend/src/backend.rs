//! The `Backend` trait: the operations the forward pass is written in.
//!
//! Ops are at the granularity a GPU wants kernels (a matmul, an RMSNorm, the mHC mix, one
//! attention over window + compressed entries, a compressor step, a MoE dispatch), so the same
//! [`crate::forward`] drives the CPU oracle and any accelerator. Per-sequence state lives in
//! the backend's `Cache`, addressed by `(sequence, layer)`.

use crate::batch::Batch;
use crate::cpu::state::SeqState;
use crate::draw::{draw_row, Draw};
use dsv4_model::weights::{Compressor, Expert, Hc};
use dsv4_model::{Config, HostTensor, LoadError};

/// Which of a CSA layer's two compressors an op addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompSlot {
    /// The attention KV compressor (CSA or HCA).
    Kv,
    /// The lightning indexer's own compressor (CSA only).
    Index,
}

/// What a replayed step hands back ([`Backend::step_output`]).
#[derive(Clone, Debug, Default)]
pub struct StepResult {
    /// `[n, vocab]`: the first `n` output rows' logits, as asked for.
    pub logits: Vec<f32>,
    /// Each output row's token under its draw (greedy: the argmax).
    pub ids: Vec<u32>,
    /// `[rows, hidden_cols]` tapped stream means (empty without taps).
    pub hidden: Vec<f32>,
    /// The first output row holding a NaN or ±∞.
    pub nonfinite: Option<usize>,
}

/// A sequence's state saved by [`Backend::save_seq_deferred`]: ready, or the host half of a
/// copy still in flight (it waits for the copy, then builds the state; any thread may run it).
pub enum SavedState {
    Ready(SeqState),
    Pending(Box<dyn FnOnce() -> SeqState + Send>),
}

impl SavedState {
    /// The state, waiting for a pending copy here.
    pub fn wait(self) -> SeqState {
        match self {
            SavedState::Ready(s) => s,
            SavedState::Pending(f) => f(),
        }
    }
}

pub trait Backend: Send + Sync {
    /// A weight resident on the backend.
    type W: Send + Sync;
    /// An activation matrix `[rows, cols]`.
    type T;
    /// Per-sequence, per-layer state (window ring, compressors, indexer).
    type Cache;
    /// The batch's row table as the backend needs it (a GPU uploads it once per forward).
    type Rows;
    /// Indexer-selected compressed entries per row.
    type Sel;
    /// Expert choice and weights per row.
    type Route;
    /// A recorded step the backend replays (CUDA graphs); `()` where it records nothing.
    type Graph: Send + Sync;
    /// Token ids left where the backend computes (the drafter's Markov loop: a slot's choice
    /// feeds the next slot's embedding with no host round trip).
    type Ids;

    fn name(&self) -> &'static str;
    /// Takes a loaded tensor; one that arrives packed ([`HostTensor::packed`]) is kept so where
    /// the backend can use it in place, and dequantised otherwise.
    fn upload(&self, t: HostTensor) -> Result<Self::W, LoadError>;
    /// Whether the loader should hand over FP8/FP4/GGUF blocks as stored (the backend then
    /// decides per tensor); `false` makes the loader dequantise everything first.
    fn keeps_packed(&self) -> bool {
        false
    }
    /// Bytes `upload(t)` would allocate; `t` may come from a dry run (no data).
    fn resident_bytes(&self, t: &HostTensor) -> u64 {
        let (r, c) = t.rows_cols();
        (r * c * 4) as u64
    }
    /// Bytes the backend can still allocate; `None` where it does not know (host memory).
    fn memory_free(&self) -> Option<u64> {
        None
    }
    fn new_cache(&self, cfg: &Config, max_seqs: usize) -> Self::Cache;
    /// Room for `tokens` positions in every slot's growing state (compressed entries, indexer
    /// keys) now, so that no step up to that length grows it: a growth reallocates every slot's
    /// entries and re-records every recorded step (~30–50 ms at 43 layers, PERF.md v24). A no-op
    /// where the state grows in host memory.
    fn reserve_state(&self, _cache: &mut Self::Cache, _tokens: usize) {}
    /// Clears one sequence's state (compressor overlap rows become `u = 0, z = −∞`, spec §9.4 #8).
    fn reset_seq(&self, cache: &mut Self::Cache, seq: usize);
    /// Copies one sequence's whole state (spec §9.1) to the host, for the prefix and disk
    /// caches. `None` where the backend cannot (yet).
    /// `len` is the number of tokens the sequence holds (backends that address rows by position
    /// need it).
    fn save_seq(&self, _cache: &Self::Cache, _cfg: &Config, _seq: usize, _len: usize) -> Option<SeqState> {
        None
    }
    /// [`Backend::save_seq`] without waiting here: a backend whose state lives on a device
    /// queues the copy behind the work already queued (so it holds the state as of now) and
    /// returns [`SavedState::Pending`], whose closure waits for the copy and builds the state
    /// on any thread; the others return the state at once.
    fn save_seq_deferred(&self, cache: &Self::Cache, cfg: &Config, seq: usize, len: usize) -> Option<SavedState> {
        self.save_seq(cache, cfg, seq, len).map(SavedState::Ready)
    }
    /// Cuts a sequence holding `have` tokens back to `len` (speculative rollback, no replay).
    fn truncate_seq(&self, _cache: &mut Self::Cache, _seq: usize, have: usize, len: usize) -> Result<(), String> {
        Err(format!("{} cannot roll sequences back (yet): {have} -> {len}", self.name()))
    }
    /// Replaces a sequence's state with a saved one; `false` where the backend cannot (yet).
    fn load_seq(&self, _cache: &mut Self::Cache, _cfg: &Config, _seq: usize, _state: &SeqState, _len: usize) -> bool {
        false
    }
    fn rows(&self, batch: &Batch) -> Self::Rows;

    fn shape(&self, t: &Self::T) -> (usize, usize);
    /// Copies a tensor to the host (captures and logits).
    fn to_host(&self, t: &Self::T) -> Vec<f32>;
    /// Each row's token under its draw (`draws[i]` for row `i`; an empty slice: every row
    /// greedy), on the host. The default runs the CPU twin ([`crate::draw::draw_row`]) over the
    /// downloaded rows; a device backend chooses where the logits are.
    fn draw_rows(&self, t: &Self::T, draws: &[Draw]) -> Vec<u32> {
        let (rows, cols) = self.shape(t);
        let host = self.to_host(t);
        (0..rows).map(|i| draw_row(&host[i * cols..(i + 1) * cols], draws.get(i).unwrap_or(&Draw::GREEDY))).collect()
    }
    /// The first `rows` rows of a tensor on the host (the output rows whose logits are asked for).
    fn to_host_rows(&self, t: &Self::T, rows: usize) -> Vec<f32> {
        let mut v = self.to_host(t);
        v.truncate(rows * self.shape(t).1);
        v
    }
    /// Takes back a host vector a step returned (its logits) once the caller is done with it,
    /// so a later download can reuse its pages (a backend that keeps none drops it).
    fn recycle_host(&self, _v: Vec<f32>) {}

    fn embed(&self, table: &Self::W, rows: &Self::Rows) -> Self::T;
    /// `x · wᵀ` with `w` stored `[out, in]`.
    fn matmul(&self, x: &Self::T, w: &Self::W) -> Self::T;
    /// `x · w_iᵀ` for each weight, results in `ws`' order: the products of one input, which a
    /// backend may run as one launch (each result as [`Backend::matmul`] gives it).
    fn matmul_many(&self, x: &Self::T, ws: &[&Self::W]) -> Vec<Self::T> {
        ws.iter().map(|w| self.matmul(x, w)).collect()
    }
    /// Grouped projection: the columns of `x` split into `groups` blocks, block `g` multiplied by
    /// rows `g·R..(g+1)·R` of `w` (`wo_a`, spec §5.7). Output `[rows, groups·R]`.
    fn grouped_matmul(&self, x: &Self::T, w: &Self::W, groups: usize) -> Self::T;
    /// RMSNorm of every `group`-wide slice of each row (group = row width for a plain norm).
    fn rms_norm(&self, x: &Self::T, w: Option<&Self::W>, group: usize, eps: f32) -> Self::T;
    /// Interleaved RoPE on the last `freqs.len()·2` channels of every `head`-wide slice.
    fn rope(&self, x: &mut Self::T, rows: &Self::Rows, freqs: &[f64], head: usize, inverse: bool);
    /// `rms_norm` of every `group`-wide slice, then `rope` on each (one launch where a backend
    /// fuses them; the same values).
    fn rms_norm_rope(
        &self,
        x: &Self::T,
        w: Option<&Self::W>,
        group: usize,
        eps: f32,
        rows: &Self::Rows,
        freqs: &[f64],
    ) -> Self::T {
        let mut y = self.rms_norm(x, w, group, eps);
        self.rope(&mut y, rows, freqs, group, false);
        y
    }
    /// The norms and rotations of a layer's attention inputs that do not depend on each other
    /// (q_a's norm with kv's norm + RoPE; the heads' norm + RoPE with the indexer query's RoPE),
    /// results in `jobs`' order, each as its own op gives it: a backend may run them as one
    /// launch. `rows` and `freqs` serve every job that rotates.
    fn norms(&self, jobs: Vec<NormJob<'_, Self::T, Self::W>>, rows: &Self::Rows, freqs: &[f64]) -> Vec<Self::T> {
        norms_apart(self, jobs, rows, freqs)
    }
    fn add(&self, a: &Self::T, b: &Self::T) -> Self::T;
    fn select_rows(&self, x: &Self::T, rows: &[usize]) -> Self::T;

    /// `n` identical copies of each row: the mHC streams after the embedding.
    fn hc_expand(&self, x: &Self::T, n: usize) -> Self::T;
    /// A `[rows, cols]` tensor for ops that fill it completely (its contents are unspecified).
    fn empty(&self, rows: usize, cols: usize) -> Self::T;
    /// `out[:, col..col + d] = mean of the n streams of x [rows, n·d]`, summed in stream order
    /// from 0 and then divided by `n` (the same f32 operations on every backend): DSpark's
    /// `main_hidden` tap (dspark §3.2), written on the backend so no layer output crosses to
    /// the host mid-forward.
    fn stream_mean_into(&self, out: &mut Self::T, col: usize, x: &Self::T, n: usize);
    /// HC_PRE (spec §4.3): returns `(y [rows, d], post [rows, n], comb [rows, n·n])`.
    fn hc_pre(&self, x: &Self::T, hc: &Hc<Self::W>, cfg: &Config) -> (Self::T, Self::T, Self::T);
    /// A hint that the weights `ws` are read soon after the next latency-bound step (the next
    /// [`Backend::hc_pre_norm`] or [`Backend::attention`]): a backend may pull them into a cache
    /// while that step runs (the CUDA backend: L2 prefetch blocks in its HC_PRE and attention
    /// launches, `CudaBackend::set_l2_prefetch`). Never changes a value; the default does nothing.
    fn prefetch(&self, _ws: &[&Self::W]) {}
    /// Opens a side branch: the ops issued until [`Backend::side_end`] read only what was
    /// issued before this call, and the ops issued after `side_end` read nothing they write
    /// until [`Backend::side_join`], so a backend may run the two chains at once (the CUDA
    /// backend: a second stream, a fork and a join in a recorded step). The forward opens two
    /// a CSA layer: its compressors beside the query path, then the indexer's query product
    /// beside the heads'. A branch opened before the last one's join follows it on the side
    /// chain. `rows`: the step's row count (a backend may keep larger steps in order). Never
    /// changes a value; the default runs in order.
    fn side_begin(&self, _rows: usize, _branch: SideBranch) {}
    /// Ends the side branch opened by [`Backend::side_begin`]: later ops are the main chain's.
    fn side_end(&self) {}
    /// Later ops wait for the side branches' work: called before anything reads their outputs.
    fn side_join(&self) {}
    /// Whether a step of `rows` runs the side branch `branch` beside the main chain. Where it
    /// does not, the forward issues the products it would split between the chains as one group
    /// (one launch where a backend groups them); the same values either way. The default: never.
    fn side_runs(&self, _rows: usize, _branch: SideBranch) -> bool {
        false
    }
    /// HC_PRE and the sub-block's RMSNorm of `y` (one launch where a backend fuses them; the
    /// same values): `(y, norm(y), post, comb)`.
    fn hc_pre_norm(
        &self,
        x: &Self::T,
        hc: &Hc<Self::W>,
        norm: &Self::W,
        cfg: &Config,
    ) -> (Self::T, Self::T, Self::T, Self::T) {
        let (y, post, comb) = self.hc_pre(x, hc, cfg);
        let a = self.rms_norm(&y, Some(norm), cfg.hidden, cfg.rms_eps);
        (y, a, post, comb)
    }
    /// HC_POST (spec §4.5): `X'[j] = post[j]·f + Σ_i comb[i][j]·X[i]`.
    fn hc_post(&self, f: &Self::T, x: &Self::T, post: &Self::T, comb: &Self::T) -> Self::T;
    /// [`Backend::hc_post`] whose result feeds the HC_PRE of `next` (the next sub-block's): a
    /// backend may form part of that HC_PRE beside it (its sums over the new streams) and keep
    /// it on the result; the values are [`Backend::hc_post`]'s either way.
    fn hc_post_next(
        &self,
        f: &Self::T,
        x: &Self::T,
        post: &Self::T,
        comb: &Self::T,
        next: &Hc<Self::W>,
        cfg: &Config,
    ) -> Self::T {
        let _ = (next, cfg);
        self.hc_post(f, x, post, comb)
    }
    /// HC_HEAD (spec §4.6).
    fn hc_head(&self, x: &Self::T, hc: &Hc<Self::W>, cfg: &Config) -> Self::T;

    /// Feeds the rows' compressor projections (`u = Wkv·x`, `z = Wgate·x`) into the sequence
    /// states; every window that closes emits an entry (spec §9.2).
    #[allow(clippy::too_many_arguments)]
    fn compress(
        &self,
        cache: &mut Self::Cache,
        layer: usize,
        slot: CompSlot,
        u: &Self::T,
        z: &Self::T,
        comp: &Compressor<Self::W>,
        rows: &Self::Rows,
        freqs: &[f64],
        cfg: &Config,
    );
    /// Lightning-indexer top-k over each row's visible entries (spec §5.5): the chosen set, in
    /// an order of the backend's (the CPU and CUDA's exact mode: score-descending, ties to the
    /// lower entry; CUDA's fast mode: entry order). The attention's sums follow that order.
    fn index_select(
        &self,
        cache: &Self::Cache,
        layer: usize,
        qi: &Self::T,
        weights: &Self::T,
        rows: &Self::Rows,
        cfg: &Config,
    ) -> Self::Sel;
    /// Sink softmax attention over window rows and visible/selected compressed entries (spec
    /// §5.6), each head's output rotated back by its row's position (the inverse RoPE with
    /// `freqs` on its last channels, before wo_a), then the chunk's KV rows enter the window
    /// ring. The rotation belongs here so that a backend can apply it where the output is formed.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        cache: &mut Self::Cache,
        layer: usize,
        q: &Self::T,
        kv: &Self::T,
        sel: Option<&Self::Sel>,
        sinks: &Self::W,
        rows: &Self::Rows,
        freqs: &[f64],
        cfg: &Config,
    ) -> Self::T;

    /// Router (spec §6.1). Hash layers pass their `tid2eid` table (`[vocab, k]` expert ids) with
    /// the rows whose tokens index it: the lookup happens on the backend (a GPU reads the tokens
    /// from its row table), so no per-step host data enters the forward.
    fn route(
        &self,
        logits: &Self::T,
        bias: Option<&Self::W>,
        hash: Option<(&[u32], &Self::Rows)>,
        cfg: &Config,
    ) -> Self::Route;
    /// The router's logits `x · gateᵀ` ([`Backend::matmul`]) and its choice of experts
    /// ([`Backend::route`]): a backend may form both in one launch, with the same values.
    fn router(
        &self,
        x: &Self::T,
        gate: &Self::W,
        bias: Option<&Self::W>,
        hash: Option<(&[u32], &Self::Rows)>,
        cfg: &Config,
    ) -> (Self::T, Self::Route) {
        let logits = self.matmul(x, gate);
        let route = self.route(&logits, bias, hash, cfg);
        (logits, route)
    }
    /// `Σ_j w_j · Expert_{idx_j}(x)` over the routed experts held here: `experts[i]` is global
    /// expert `first + i`; slots routed to experts outside that range add nothing (expert
    /// parallel ranks, see [`dsv4_model::Shard`]).
    fn moe(&self, x: &Self::T, route: &Self::Route, experts: &[Expert<Self::W>], first: usize, limit: f32) -> Self::T;
    /// Whether [`Backend::moe`] takes a share of the experts (`first > 0` or fewer experts than
    /// the router chooses from); backends that index every expert say `false`.
    fn expert_parallel(&self) -> bool {
        false
    }
    /// One clamped-SwiGLU expert applied to every row (the shared expert).
    fn swiglu(&self, x: &Self::T, e: &Expert<Self::W>, limit: f32) -> Self::T;
    /// The MoE block's experts: the routed sum ([`Backend::moe`]), the shared expert
    /// ([`Backend::swiglu`]) and their sum, each named by the forward (`ffn.routed`,
    /// `ffn.shared`, then the block's output). A backend may form all three in fewer launches,
    /// with the same values.
    fn moe_shared(
        &self,
        x: &Self::T,
        route: &Self::Route,
        experts: &[Expert<Self::W>],
        first: usize,
        shared: &Expert<Self::W>,
        limit: f32,
    ) -> (Self::T, Self::T, Self::T) {
        moe_shared_apart(self, x, route, experts, first, shared, limit)
    }

    /// Clears the cache's nonfinite probes (start of a checked forward).
    fn reset_probes(&self, cache: &mut Self::Cache);
    /// Records in probe `slot`, without synchronising (a GPU queues it on its stream), whether
    /// `t` holds a NaN or ±∞, and the first row that does.
    fn probe_finite(&self, cache: &mut Self::Cache, t: &Self::T, slot: usize);
    /// The first `n` probes since the last reset: `Some(first nonfinite row)` or `None` when the
    /// stage was finite. Read once after a forward (one synchronisation on a GPU).
    fn read_probes(&self, cache: &Self::Cache, n: usize) -> Vec<Option<usize>>;

    // Recorded steps ([`crate::model::Model`] records decode and verify steps once per shape and
    // replays them). A backend that records nothing keeps the defaults.

    /// The most rows a recorded step of a model of `cfg`'s shapes may hold; 0 where the backend
    /// records nothing.
    fn graph_max_rows(&self, _cfg: &Config) -> usize {
        0
    }
    /// Before a recorded step is recorded or replayed: copies its inputs (row table, output
    /// rows, the output rows' draws) into the shape's persistent buffers with one stream-ordered copy, and does on the
    /// host what the recorded work cannot (state growth, bookkeeping). `cols` is the logits'
    /// width, `hidden_cols` the tapped stream means' (0: no taps). Returns the cache's
    /// generation: a graph recorded under another one addresses buffers that have moved.
    fn prepare_step(
        &self,
        _cache: &mut Self::Cache,
        _batch: &Batch,
        _out_rows: &[usize],
        _draws: &[Draw],
        _cols: usize,
        _hidden_cols: usize,
    ) -> u64 {
        0
    }
    /// Starts recording the forward of the prepared step of this shape (nothing runs until
    /// [`Backend::replay`]); `false` where it cannot.
    fn begin_record(&self, _rows: usize, _out: usize, _hidden_cols: usize) -> bool {
        false
    }
    /// Ends the recording; the forward's `logits` (and tapped `hidden`) go to the step's output
    /// buffers, with the logits' nonfinite check and each row's token (its draw) recorded
    /// beside them.
    fn end_record(&self, _logits: Self::T, _hidden: Option<Self::T>) -> Result<Self::Graph, String> {
        Err(format!("the {} backend records no steps", self.name()))
    }
    /// Runs a recorded step over the inputs [`Backend::prepare_step`] staged.
    fn replay(&self, _g: &Self::Graph) {}
    /// The kernel launches a recorded step holds (issue 11 counts them a layer); 0 where unknown.
    fn graph_kernels(&self, _g: &Self::Graph) -> usize {
        0
    }
    /// The replayed step's results on the host (one synchronisation): every output row's
    /// token, and the logits of the first `logits` output rows.
    fn step_output(&self, _g: &Self::Graph, _logits: usize) -> StepResult {
        StepResult { nonfinite: Some(0), ..Default::default() }
    }

    // DSpark drafter ops (spec `dspark.md` §3.3–§3.6).

    /// A tensor `[rows, cols]` from host data (captured target rows entering the drafter).
    fn to_device(&self, rows: usize, cols: usize, data: &[f32]) -> Self::T;
    /// `dst[dst_rows[i]] = src[i]` for every row of `src` (context-ring writes).
    fn scatter_rows(&self, dst: &mut Self::T, src: &Self::T, dst_rows: &[usize]);
    /// DSparkAttention's core: non-causal sink-softmax attention with K = V and scale `hd^-½`
    /// (`hd = kb.cols`), `sinks [heads]` in the denominator only. The query rows
    /// `q [rows, heads·hd]` form `rings.len()` equal groups (one drafted block each); group `g`
    /// attends to rows `slots[g]` of `rings[g]` (in that order), then to every one of its own
    /// block key rows `kb [rows, hd]`. Returns `[rows, heads·hd]`.
    fn block_attention(
        &self,
        q: &Self::T,
        kb: &Self::T,
        rings: &[&Self::T],
        slots: &[Vec<usize>],
        sinks: &Self::W,
        heads: usize,
    ) -> Self::T;
    /// The first index of the maximum of every row, on the host (greedy draft choice).
    fn argmax_rows(&self, x: &Self::T) -> Vec<u32>;
    /// [`Backend::argmax_rows`], left on the backend (nothing waits).
    fn argmax_ids(&self, x: &Self::T) -> Self::Ids;
    /// Host token ids on the backend.
    fn upload_ids(&self, ids: &[u32]) -> Self::Ids;
    /// Rows `ids` of `table`: [`Backend::embed`] of rows with those tokens.
    fn embed_ids(&self, table: &Self::W, ids: &Self::Ids) -> Self::T;
    /// `ids` on the host (waits for the backend).
    fn ids_to_host(&self, ids: &Self::Ids) -> Vec<u32>;
    /// `parts` one after the other, on the backend (one download for several slots' ids).
    fn concat_ids(&self, parts: &[&Self::Ids]) -> Self::Ids;
    /// The drafter's greedy Markov slot (dspark.md §3.6) for every sequence `i`: the first index
    /// of the maximum of `Z_i = u[rows[i]] + markov_w2 · markov_w1[prev[i]]`, left on the
    /// backend. The default is [`markov_argmax_ops`]; a backend may fuse it where it gives the
    /// same ids.
    fn markov_argmax(&self, u: &Self::T, rows: &[usize], prev: &Self::Ids, w1: &Self::W, w2: &Self::W) -> Self::Ids {
        markov_argmax_ops(self, u, rows, prev, w1, w2)
    }
}

/// [`Backend::markov_argmax`] as its ops: the rows of `u`, the previous tokens' `markov_w1`
/// rows, their `markov_w2` product, the add and the row argmax.
pub fn markov_argmax_ops<B: Backend + ?Sized>(
    b: &B,
    u: &B::T,
    rows: &[usize],
    prev: &B::Ids,
    w1: &B::W,
    w2: &B::W,
) -> B::Ids {
    let uk = b.select_rows(u, rows);
    let e = b.embed_ids(w1, prev);
    let bias = b.matmul(&e, w2);
    b.argmax_ids(&b.add(&uk, &bias))
}

/// One job of [`Backend::norms`].
pub enum NormJob<'a, T, W> {
    /// [`Backend::rms_norm`] of `x`, or [`Backend::rms_norm_rope`] where `rope`.
    Norm { x: &'a T, w: Option<&'a W>, group: usize, eps: f32, rope: bool },
    /// [`Backend::rope`] (forward) of `x`'s `head`-wide slices, in place.
    Rope { x: T, head: usize },
}

/// [`Backend::norms`] one op a job (the default, and a backend's fallback).
pub fn norms_apart<B: Backend + ?Sized>(
    b: &B,
    jobs: Vec<NormJob<'_, B::T, B::W>>,
    rows: &B::Rows,
    freqs: &[f64],
) -> Vec<B::T> {
    jobs.into_iter()
        .map(|j| match j {
            NormJob::Norm { x, w, group, eps, rope: false } => b.rms_norm(x, w, group, eps),
            NormJob::Norm { x, w, group, eps, rope: true } => b.rms_norm_rope(x, w, group, eps, rows, freqs),
            NormJob::Rope { mut x, head } => {
                b.rope(&mut x, rows, freqs, head, false);
                x
            }
        })
        .collect()
}

/// The side branches the forward opens ([`Backend::side_begin`]); each is a bit of a backend's
/// mask (the CUDA backend's `DSV4_SIDE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SideBranch {
    /// A layer's compressors (their products and state updates) beside its query path.
    Compressors = 1,
    /// The indexer's query product beside the heads'.
    IndexQuery = 2,
}

/// [`Backend::moe_shared`] as three calls: the routed experts, the shared expert, their sum (the
/// default, and a backend's fallback where its fused path does not apply).
pub fn moe_shared_apart<B: Backend + ?Sized>(
    b: &B,
    x: &B::T,
    route: &B::Route,
    experts: &[Expert<B::W>],
    first: usize,
    shared: &Expert<B::W>,
    limit: f32,
) -> (B::T, B::T, B::T) {
    let routed = b.moe(x, route, experts, first, limit);
    let shared = b.swiglu(x, shared, limit);
    let out = b.add(&routed, &shared);
    (routed, shared, out)
}
