//! The DeepSeek V4 forward pass, written once over [`Backend`].
//!
//! One code path for prefill, decode, speculative verify and multi-sequence batches: the input
//! is always a [`Batch`] of rows. Every intermediate is handed to the optional [`Capture`] under
//! a [`Stage`] name; capturing only reads.

use crate::backend::{Backend, CompSlot, NormJob, SideBranch};
use crate::batch::Batch;
use crate::comm::Comm;
use dsv4_model::weights::{Hc, Layer, Weights};
use dsv4_model::{AttnKind, Config};

/// The name of an intermediate: `(layer, stage)`; `layer` is `None` outside the decoder layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Stage {
    pub layer: Option<usize>,
    pub name: &'static str,
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.layer {
            Some(l) => write!(f, "layers.{l}.{}", self.name),
            None => f.write_str(self.name),
        }
    }
}

/// Receives intermediates during a forward.
pub trait Capture<B: Backend> {
    fn capture(&mut self, backend: &B, stage: Stage, t: &B::T);
}

/// Per-layer RoPE frequency tables, computed once per model.
pub struct RopeTables {
    pub main: Vec<f64>,
    pub compress: Vec<f64>,
}

impl RopeTables {
    pub fn new(cfg: &Config) -> Self {
        RopeTables { main: cfg.rope_freqs(AttnKind::Swa), compress: cfg.rope_freqs(AttnKind::Csa) }
    }
    fn of(&self, kind: AttnKind) -> &[f64] {
        if kind == AttnKind::Swa {
            &self.main
        } else {
            &self.compress
        }
    }
}

struct Ctx<'a, 'c, B: Backend> {
    b: &'a B,
    cfg: &'a Config,
    rope: &'a RopeTables,
    rows: &'a B::Rows,
    cache: &'a mut B::Cache,
    cap: Option<&'a mut (dyn Capture<B> + 'c)>,
    comm: &'a dyn Comm<B>,
    /// The probed stages in forward order (probe slot `i` is `probes[i]`); `None`: no probes.
    probes: Option<Vec<Stage>>,
    /// Which stages are probed when `probes` is set.
    probe: Probe,
}

/// Which named stages of a forward are probed for nonfinite values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    /// None (a recorded step: its logits are checked after the replay).
    Off,
    /// The embedding, each sub-block's residual streams and the logits: every nonfinite value
    /// that reaches the streams shows in the sub-block it came from, for a fraction of the
    /// bytes (an 8K prefill chunk's 81 stage probes were 12 % of its time on the H200).
    Layers,
    /// Every named stage: the error names the first stage a nonfinite value reaches.
    Stages,
}

impl Probe {
    fn takes(self, name: &str) -> bool {
        match self {
            Probe::Off => false,
            Probe::Layers => matches!(name, "embed" | "attn.residual" | "ffn.residual" | "logits"),
            Probe::Stages => true,
        }
    }
}

impl<B: Backend> Ctx<'_, '_, B> {
    /// A named stage: probed for nonfinite values (checked forwards) and handed to the capture.
    fn cap(&mut self, layer: Option<usize>, name: &'static str, t: &B::T) {
        let stage = Stage { layer, name };
        let probed = self.probe.takes(name);
        if let Some(p) = self.probes.as_mut().filter(|_| probed) {
            self.b.probe_finite(self.cache, t, p.len());
            p.push(stage);
        }
        if let Some(c) = self.cap.as_deref_mut() {
            c.capture(self.b, stage, t);
        }
    }
}

/// What a forward computes beyond the state update: the logits of `out_rows` and, for every
/// row, the stream mean of each layer in `taps` (DSpark's `main_hidden`, dspark §3.2).
#[derive(Clone, Copy, Debug, Default)]
pub struct Outputs<'a> {
    /// Rows whose logits are returned (`[out_rows.len(), vocab]`).
    pub out_rows: &'a [usize],
    /// Layers (ascending) whose output stream mean is returned for every row of the batch,
    /// concatenated per row: `[rows, taps.len()·hidden]`.
    pub taps: &'a [usize],
}

/// A forward's results on the backend.
pub struct Forwarded<T> {
    pub logits: T,
    /// The tapped stream means; `None` when no layer is tapped.
    pub hidden: Option<T>,
    /// The probed stages in forward order (checked forwards only).
    pub stages: Vec<Stage>,
}

/// Runs `batch` through the model, updating every sequence's state, and returns the logits of
/// the rows listed in `out_rows` (`[out_rows.len(), vocab]`).
///
/// The caller (see [`crate::model::Model`]) has validated the batch against the sequences' lengths.
/// `w` and `cfg` are this rank's share and its local configuration
/// ([`dsv4_model::Shard::local_config`]); `comm` joins the ranks ([`crate::comm::Single`] alone).
#[allow(clippy::too_many_arguments)]
pub fn forward<B: Backend>(
    b: &B,
    cfg: &Config,
    w: &Weights<B::W>,
    rope: &RopeTables,
    cache: &mut B::Cache,
    batch: &Batch,
    out_rows: &[usize],
    cap: Option<&mut dyn Capture<B>>,
    comm: &dyn Comm<B>,
) -> B::T {
    run(b, cfg, w, rope, cache, batch, Outputs { out_rows, taps: &[] }, cap, comm, Probe::Off).logits
}

/// The forward with its [`Outputs`] spelled out and the named stages that `probe` selects
/// probed for nonfinite values ([`Backend::probe_finite`], no synchronisation): probe slot `i`
/// of the cache belongs to stage `i` of the result's `stages` (read them with
/// [`Backend::read_probes`]).
#[allow(clippy::too_many_arguments)]
pub fn forward_outputs<B: Backend>(
    b: &B,
    cfg: &Config,
    w: &Weights<B::W>,
    rope: &RopeTables,
    cache: &mut B::Cache,
    batch: &Batch,
    outs: Outputs<'_>,
    cap: Option<&mut dyn Capture<B>>,
    comm: &dyn Comm<B>,
    probe: Probe,
) -> Forwarded<B::T> {
    run(b, cfg, w, rope, cache, batch, outs, cap, comm, probe)
}

#[allow(clippy::too_many_arguments)]
fn run<B: Backend>(
    b: &B,
    cfg: &Config,
    w: &Weights<B::W>,
    rope: &RopeTables,
    cache: &mut B::Cache,
    batch: &Batch,
    outs: Outputs<'_>,
    cap: Option<&mut dyn Capture<B>>,
    comm: &dyn Comm<B>,
    probe: Probe,
) -> Forwarded<B::T> {
    let rows = b.rows(batch);
    let on = probe != Probe::Off;
    if on {
        b.reset_probes(cache);
    }
    let probes = on.then(Vec::new);
    let mut cx = Ctx { b, cfg, rope, rows: &rows, cache, cap, comm, probes, probe };
    let e = b.embed(&w.embed, &rows);
    cx.cap(None, "embed", &e);
    let mut x = b.hc_expand(&e, cfg.hc_mult);
    let mut hidden = (!outs.taps.is_empty()).then(|| b.empty(batch.len(), outs.taps.len() * cfg.hidden));
    for (l, lw) in w.layers.iter().enumerate() {
        let names = ["attn.hc_pre", "attn.norm", "attn.residual"];
        let next = Some(&lw.hc_ffn);
        // The attention's first products (its input's wq_a / wkv, then wq_b) may be prefetched
        // under HC_PRE; the FFN's router and shared expert likewise.
        let pf = [&lw.attn.wq_a, &lw.attn.wkv, &lw.attn.wq_b];
        x = sub_block(&mut cx, l, &x, SubHc { hc: &lw.hc_attn, next, prefetch: &pf }, &lw.attn_norm, names, |cx, a| {
            attention(cx, l, lw, a)
        });
        let names = ["ffn.hc_pre", "ffn.norm", "ffn.residual"];
        let next = w.layers.get(l + 1).map(|n| &n.hc_attn);
        let sh = &lw.ffn.shared;
        let pf = [&lw.ffn.gate, &sh.w1, &sh.w3, &sh.w2];
        x = sub_block(&mut cx, l, &x, SubHc { hc: &lw.hc_ffn, next, prefetch: &pf }, &lw.ffn_norm, names, |cx, f| {
            moe(cx, l, lw, f)
        });
        if let (Some(h), Some(j)) = (hidden.as_mut(), outs.taps.iter().position(|&t| t == l)) {
            b.stream_mean_into(h, j * cfg.hidden, &x, cfg.hc_mult);
        }
    }
    let xs = b.select_rows(&x, outs.out_rows);
    let h = b.hc_head(&xs, &w.hc_head, cfg);
    cx.cap(None, "head.hc", &h);
    let h = b.rms_norm(&h, Some(&w.norm), cfg.hidden, cfg.rms_eps);
    cx.cap(None, "head.norm", &h);
    // Each rank holds a share of the vocabulary rows.
    let logits = comm.all_gather_cols(b, b.matmul(&h, &w.head), cfg.vocab_size);
    cx.cap(None, "logits", &logits);
    Forwarded { logits, hidden, stages: cx.probes.unwrap_or_default() }
}

/// A sub-block's mHC weights: its HC_PRE's, the next sub-block's (none after the last layer) and
/// the weights its body reads first ([`Backend::prefetch`]).
struct SubHc<'w, W> {
    hc: &'w Hc<W>,
    next: Option<&'w Hc<W>>,
    prefetch: &'w [&'w W],
}

/// One pre-norm sub-block through mHC: collapse the streams (HC_PRE), normalise, run `body`,
/// and mix its output back into the streams (HC_POST). `names` label those three stages.
fn sub_block<'a, 'c, B: Backend>(
    cx: &mut Ctx<'a, 'c, B>,
    l: usize,
    x: &B::T,
    SubHc { hc, next, prefetch }: SubHc<'_, B::W>,
    norm: &B::W,
    names: [&'static str; 3],
    body: impl FnOnce(&mut Ctx<'a, 'c, B>, &B::T) -> B::T,
) -> B::T {
    let (b, cfg) = (cx.b, cx.cfg);
    b.prefetch(prefetch);
    let (y, a, post, comb) = b.hc_pre_norm(x, hc, norm, cfg);
    cx.cap(Some(l), names[0], &y);
    cx.cap(Some(l), names[1], &a);
    let o = body(cx, &a);
    let x = match next {
        Some(next) => b.hc_post_next(&o, x, &post, &comb, next, cfg),
        None => b.hc_post(&o, x, &post, &comb),
    };
    cx.cap(Some(l), names[2], &x);
    x
}

fn attention<B: Backend>(cx: &mut Ctx<'_, '_, B>, l: usize, lw: &Layer<B::W>, a: &B::T) -> B::T {
    let (b, cfg) = (cx.b, cx.cfg);
    let spec = cfg.layers[l];
    let aw = &lw.attn;
    let freqs = cx.rope.of(spec.attn);
    let li = Some(l);
    let (d, eps) = (cfg.head_dim, cfg.rms_eps);

    // Whether the side branches below run beside the main chain; where they do not, their
    // products join the main chain's in one group (one launch a format where a backend groups).
    let rows = b.shape(a).0;
    let (beside, beside_q) = (b.side_runs(rows, SideBranch::Compressors), b.side_runs(rows, SideBranch::IndexQuery));

    // The compressors' products and state updates go on a side branch: they read only the
    // attention input and write only their own states, so a backend may run them beside the
    // query path below (spec §9.4 #6 needs them before the indexer and the attention, which
    // come after the join). wq_a's and wkv's product comes first, so that anything a backend
    // keeps on the input for its products (a cast, int8 codes) is made on the main chain.
    let mut cws = Vec::new();
    if let Some(c) = &aw.compressor {
        cws.extend([&c.wkv, &c.wgate]);
    }
    if let Some(ix) = &aw.indexer {
        cws.extend([&ix.compressor.wkv, &ix.compressor.wgate, &ix.weights_proj]);
    }
    let side = beside && !cws.is_empty();
    let mut ws = vec![&aw.wq_a, &aw.wkv];
    if !side {
        ws.extend(&cws);
    }
    let mut pa = b.matmul_many(a, &ws).into_iter();
    let (q_a, kv_a) = (pa.next().expect("wq_a's product"), pa.next().expect("wkv's product"));
    if side {
        b.side_begin(rows, SideBranch::Compressors);
    }
    let mut pc = if side { b.matmul_many(a, &cws) } else { pa.collect() }.into_iter();
    let mut next_c = || pc.next().expect("one product a weight");
    let comp_uz = aw.compressor.as_ref().map(|c| {
        let (u, z) = (next_c(), next_c());
        b.compress(cx.cache, l, CompSlot::Kv, &u, &z, c, cx.rows, freqs, cfg);
        (u, z)
    });
    let index_uzw = aw.indexer.as_ref().map(|ix| {
        let (u, z, wts) = (next_c(), next_c(), next_c());
        b.compress(cx.cache, l, CompSlot::Index, &u, &z, &ix.compressor, cx.rows, freqs, cfg);
        (u, z, wts)
    });
    if side {
        b.side_end();
    }

    // q_a's norm and kv's norm + RoPE, which a backend may run as one launch (so a stage timer,
    // `DSV4_PROFILE`, counts kv's norm in attn.q_a and the indexer query's RoPE in attn.q).
    let mut n1 = b
        .norms(
            vec![
                NormJob::Norm { x: &q_a, w: Some(&aw.q_norm), group: cfg.q_lora_rank, eps, rope: false },
                NormJob::Norm { x: &kv_a, w: Some(&aw.kv_norm), group: d, eps, rope: true },
            ],
            cx.rows,
            freqs,
        )
        .into_iter();
    let (qr, kv) = (n1.next().expect("q_a's norm"), n1.next().expect("kv's norm"));
    cx.cap(li, "attn.q_a", &qr);
    // The query projections of qr: the heads' and, where the layer has one, the indexer's, the
    // latter on a second side branch beside the former (after the compressors on the side
    // chain), else both at once. (Where qr's norm left no twin the indexer's product needs, a
    // backend makes it inside the branch and the main chain waits for the side there.)
    let (qh, qi) = match &aw.indexer {
        Some(ix) if beside_q => {
            b.side_begin(rows, SideBranch::IndexQuery);
            let qi = b.matmul(&qr, &ix.wq_b);
            b.side_end();
            (b.matmul(&qr, &aw.wq_b), Some(qi))
        }
        Some(ix) => {
            let mut pq = b.matmul_many(&qr, &[&aw.wq_b, &ix.wq_b]).into_iter();
            (pq.next().expect("the heads' query projection"), pq.next())
        }
        None => (b.matmul(&qr, &aw.wq_b), None),
    };
    // The indexer's query (the second branch's output, after the first's on the side chain) is
    // read from here on.
    if beside_q {
        b.side_join();
    }
    // The heads' norm + RoPE and the indexer query's RoPE, again one launch where a backend can.
    let mut jobs = vec![NormJob::Norm { x: &qh, w: None, group: d, eps, rope: true }];
    if let Some(qi) = qi {
        jobs.push(NormJob::Rope { x: qi, head: cfg.index_head_dim });
    }
    let mut n2 = b.norms(jobs, cx.rows, freqs).into_iter();
    let q = n2.next().expect("the heads' norm");
    let qi = n2.next();
    cx.cap(li, "attn.q", &q);
    cx.cap(li, "attn.kv", &kv);

    // The compressors' outputs are read from here on (joined already where the second branch
    // ran).
    if beside {
        b.side_join();
    }
    if let Some((u, z)) = &comp_uz {
        cx.cap(li, "attn.compressor.kv", u);
        cx.cap(li, "attn.compressor.gate", z);
    }
    let sel = match index_uzw {
        Some((u, z, wts)) => {
            cx.cap(li, "attn.indexer.compressor.kv", &u);
            cx.cap(li, "attn.indexer.compressor.gate", &z);
            let qi = qi.expect("the indexer's rotated query");
            cx.cap(li, "attn.indexer.q", &qi);
            let sel = b.index_select(cx.cache, l, &qi, &wts, cx.rows, cfg);
            // Captured after the selection, so a stage timer (`DSV4_PROFILE`) tells the
            // indexer's scores and top-k apart from the attention.
            cx.cap(li, "attn.indexer.weights", &wts);
            Some(sel)
        }
        None => None,
    };
    // Rotated back by position already (the inverse RoPE is part of the attention's output);
    // wo_a may be prefetched under it.
    b.prefetch(&[&aw.wo_a]);
    let o = b.attention(cx.cache, l, &q, &kv, sel.as_ref(), &aw.sinks, cx.rows, freqs, cfg);
    cx.cap(li, "attn.core", &o);
    let z = b.grouped_matmul(&o, &aw.wo_a, cfg.o_groups);
    cx.cap(li, "attn.wo_a", &z);
    // Each rank's heads give a partial sum over `wo_b`'s input columns.
    let mut out = b.matmul(&z, &aw.wo_b);
    cx.comm.all_reduce(b, &mut out);
    cx.cap(li, "attn.out", &out);
    out
}

fn moe<B: Backend>(cx: &mut Ctx<'_, '_, B>, l: usize, lw: &Layer<B::W>, f: &B::T) -> B::T {
    let (b, cfg) = (cx.b, cx.cfg);
    let m = &lw.ffn;
    let li = Some(l);
    let hash = m.tid2eid.as_deref().map(|t| (t, cx.rows));
    let (logits, route) = b.router(f, &m.gate, m.bias.as_ref(), hash, cfg);
    cx.cap(li, "ffn.router", &logits);
    // On a rank of a group, `routed` sums only its own experts and `shared` only its share of
    // the shared expert's rows: one all-reduce of their sum completes both.
    let (routed, shared, mut out) = b.moe_shared(f, &route, &m.experts, m.expert0, &m.shared, cfg.swiglu_limit);
    cx.cap(li, "ffn.routed", &routed);
    cx.cap(li, "ffn.shared", &shared);
    cx.comm.all_reduce(b, &mut out);
    cx.cap(li, "ffn.out", &out);
    out
}
