//! The DSpark drafter (spec §3.3–§3.6): context fusion, ring writes, the non-causal block
//! through the draft stages, and the Markov/confidence heads, written once over [`Backend`] ops.
//! `Drafter<CpuBackend>` (the default) is the f32 reference; `Drafter<CudaBackend>` keeps its
//! weights and the per-sequence context rings on the GPU and drafts many sequences in one
//! batched forward ([`Drafter::draft_batch`]).

use std::path::Path;

use dsv4_backend::backend::NormJob;
use dsv4_backend::cpu::CpuBackend;
use dsv4_backend::{Backend, Batch, Row};
use dsv4_model::{AttnKind, Config, LoadError, TensorStore};
use rand::Rng;

use crate::ring::Ring;
use crate::weights::{self, DrafterWeights};
use crate::{DsparkConfig, DsparkError};

pub use dsv4_backend::cpu::dspark::{argmax, block_attention};

/// One drafted block.
#[derive(Clone, Debug, PartialEq)]
pub struct Draft {
    /// `tokens[k]` is the draft for position `anchor_pos + 1 + k` (γ tokens).
    pub tokens: Vec<u32>,
    /// The Markov-corrected logits `Z_k` the tokens were chosen from, `[γ, vocab]`; empty when
    /// the caller did not ask for them ([`Drafter::draft_batch`] without `with_logits`).
    pub logits: Vec<f32>,
    /// The exact draft distributions `q_k = softmax(Z_k / T)`, `[γ, vocab]`, for rejection
    /// sampling; `None` at temperature 0 (each `q_k` is then a point mass on `tokens[k]`).
    pub q_probs: Option<Vec<f32>>,
    /// Raw confidence logits (the reference head has no sigmoid); see [`Draft::confidence`].
    pub conf_raw: Vec<f32>,
    pub vocab: usize,
}

impl Draft {
    /// `c_k = sigmoid(conf_raw[k])`: the predicted probability that `tokens[k]` is accepted
    /// given that `tokens[..k]` were (spec §5).
    pub fn confidence(&self, k: usize) -> f32 {
        sigmoid(self.conf_raw[k])
    }

    /// Prefix survival `a_k = Π_{i≤k} c_i` for every slot.
    pub fn survival(&self) -> Vec<f32> {
        let mut a = 1.0;
        (0..self.tokens.len())
            .map(|k| {
                a *= self.confidence(k);
                a
            })
            .collect()
    }

    /// `q_k` as a row (`None` at temperature 0).
    pub fn q(&self, k: usize) -> Option<&[f32]> {
        self.q_probs.as_ref().map(|q| &q[k * self.vocab..(k + 1) * self.vocab])
    }
}

/// Intermediates of one block (tests and debugging).
#[derive(Clone, Debug, Default)]
pub struct Trace {
    /// mHC stream after each stage, `[stages][γ, hc·d]`.
    pub stage_out: Vec<Vec<f32>>,
    /// Each stage's DSparkAttention output, `[stages][γ, d]`.
    pub attn_out: Vec<Vec<f32>>,
    /// `hc_head` output (pre-norm; the confidence input), `[γ, d]`.
    pub h: Vec<f32>,
    /// `head(norm(h))` before the Markov bias, `[γ, vocab]`.
    pub base_logits: Vec<f32>,
    /// The previous token of each slot (the anchor for slot 0).
    pub markov_prev: Vec<u32>,
    /// `markov_w1[prev]`, `[γ, r]`.
    pub markov_embed: Vec<f32>,
    /// `markov_w2 · markov_w1[prev]`, `[γ, vocab]`.
    pub markov_bias: Vec<f32>,
    /// Slots of the ring the block attended to.
    pub ring_slots: Vec<usize>,
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// One sequence's block to draft: its ring, the anchor token and the anchor's position `P+1`
/// (the ring must hold `P`).
pub struct DraftRequest<'a, T> {
    pub ring: &'a Ring<T>,
    pub anchor: u32,
    pub anchor_pos: usize,
}

/// One sequence's part of [`Drafter::commit_batch`]: its ring and its committed rows
/// `(position, captured hidden)`.
pub type CommitItem<'a, T> = (&'a mut Ring<T>, &'a [(usize, &'a [f32])]);

/// How the Markov loop picks tokens.
enum Choice<'a, R: ?Sized> {
    /// First maximum, on the backend (only the token ids come back to the host).
    Greedy { with_logits: bool },
    /// `softmax(Z_k / T)` sampled on the host (the rows come back).
    Sampled { temperature: f32, rng: &'a mut R },
}

/// The DSpark drafter: weights on backend `B` plus the target config they belong to.
/// Stateless; the per-sequence state is a [`Ring`] of `B`'s tensors ([`crate::ContextRing`] on the CPU).
pub struct Drafter<B: Backend = CpuBackend> {
    cfg: Config,
    dcfg: DsparkConfig,
    w: DrafterWeights<B::W>,
    /// RoPE of the stages: plain `rope_theta`, no YaRN (ratio-0 layers).
    freqs: Vec<f64>,
    b: B,
}

impl Drafter<CpuBackend> {
    /// Loads the drafter of a checkpoint: `store` holds the target and `mtp.<s>.*` tensors,
    /// `cfg` is the target's config.
    pub fn load(store: &TensorStore, cfg: &Config, dcfg: &DsparkConfig) -> Result<Self, DsparkError> {
        let w = weights::load(store, cfg, dcfg)?;
        Ok(Self::from_weights(cfg.clone(), dcfg.clone(), w))
    }

    /// Loads from a checkpoint directory (`config.json` in either layout with the `dspark_*`
    /// keys, plus safetensors).
    pub fn load_dir(dir: &Path) -> Result<Self, DsparkError> {
        let (cfg, dcfg, w) = load_host(dir)?;
        Ok(Self::from_weights(cfg, dcfg, w))
    }

    pub fn from_weights(cfg: Config, dcfg: DsparkConfig, w: DrafterWeights) -> Self {
        Drafter::new(CpuBackend, cfg, dcfg, w)
    }

    /// `markov_w1[prev]` (`[r]`).
    pub fn markov_embed(&self, prev: u32) -> &[f32] {
        self.w.heads.markov_w1.row(prev as usize)
    }

    /// The Markov bias for a previous token: `markov_w2 · markov_w1[prev]` (`[vocab]`).
    pub fn markov_bias(&self, prev: u32) -> Vec<f32> {
        let e = self.w.heads.markov_w1.row(prev as usize);
        let w2 = &self.w.heads.markov_w2;
        (0..w2.rows).map(|v| dsv4_backend::cpu::linalg::dot(w2.row(v), e)).collect()
    }

    /// The confidence head's raw logit for a pre-norm head hidden `h [d]` and previous token.
    pub fn confidence_raw(&self, h: &[f32], prev: u32) -> f32 {
        use dsv4_backend::cpu::linalg::dot;
        let hw = &self.w.heads;
        dot(&hw.conf_h.data, h) + dot(&hw.conf_e.data, hw.markov_w1.row(prev as usize))
    }
}

/// Config, DSpark config and host weights of a checkpoint directory.
pub fn load_host(dir: &Path) -> Result<(Config, DsparkConfig, DrafterWeights), DsparkError> {
    let cfg = Config::from_dir(dir).map_err(LoadError::from)?;
    let path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&path).map_err(|source| LoadError::Io { path: path.display().to_string(), source })?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| DsparkError::Config { field: "config.json".into(), msg: e.to_string() })?;
    let dcfg = DsparkConfig::from_json(&v, cfg.n_layers(), cfg.vocab_size)?
        .ok_or_else(|| DsparkError::NotDspark("config.json has no `dspark_block_size`".into()))?;
    let store = TensorStore::open(dir)?;
    let w = weights::load(&store, &cfg, &dcfg)?;
    Ok((cfg, dcfg, w))
}

impl<B: Backend> Drafter<B> {
    /// A drafter over weights already on `b`.
    pub fn new(b: B, cfg: Config, dcfg: DsparkConfig, w: DrafterWeights<B::W>) -> Self {
        let freqs = cfg.rope_freqs(AttnKind::Swa);
        Drafter { cfg, dcfg, w, freqs, b }
    }

    /// Uploads host weights to `b` (its storage rules apply, e.g. bf16 matrices on a GPU).
    pub fn upload(b: B, cfg: Config, dcfg: DsparkConfig, w: DrafterWeights) -> Result<Self, DsparkError> {
        let w = w.upload(&b, &cfg, &dcfg)?;
        Ok(Self::new(b, cfg, dcfg, w))
    }

    /// Loads a checkpoint directory's drafter onto `b`.
    pub fn load_dir_on(b: B, dir: &Path) -> Result<Self, DsparkError> {
        let (cfg, dcfg, w) = load_host(dir)?;
        Self::upload(b, cfg, dcfg, w)
    }

    pub fn backend(&self) -> &B {
        &self.b
    }

    pub fn config(&self) -> &DsparkConfig {
        &self.dcfg
    }

    pub fn target_config(&self) -> &Config {
        &self.cfg
    }

    pub fn weights(&self) -> &DrafterWeights<B::W> {
        &self.w
    }

    pub fn n_stages(&self) -> usize {
        self.w.stages.len()
    }

    pub fn block_size(&self) -> usize {
        self.dcfg.block_size
    }

    /// Width of one captured target row (`len(target_layer_ids) · hidden`).
    pub fn hidden_width(&self) -> usize {
        self.dcfg.target_layer_ids.len() * self.cfg.hidden
    }

    /// A fresh (empty) per-sequence state: one ring of `window` rows per stage, on the backend.
    pub fn new_ring(&self) -> Ring<B::T> {
        let (win, hd) = (self.cfg.window, self.cfg.head_dim);
        let zeros = vec![0f32; win * hd];
        Ring::from_stages((0..self.n_stages()).map(|_| self.b.to_device(win, hd, &zeros)).collect(), win, hd)
    }

    /// `main_x = main_norm(main_proj · main_hidden)` for `[rows, hidden_width]` captured rows.
    pub fn main_x(&self, hidden: &[f32]) -> Result<Vec<f32>, DsparkError> {
        let w = self.hidden_width();
        if !hidden.len().is_multiple_of(w) {
            return Err(DsparkError::HiddenWidth { expected: w, found: hidden.len() });
        }
        Ok(self.b.to_host(&self.main_x_t(&self.b.to_device(hidden.len() / w, w, hidden))))
    }

    fn main_x_t(&self, x: &B::T) -> B::T {
        let y = self.b.matmul(x, &self.w.main_proj);
        self.b.rms_norm(&y, Some(&self.w.main_norm), self.cfg.hidden, self.cfg.rms_eps)
    }

    /// A row table for rows at `positions` carrying `tokens` (each row its own sequence: only the
    /// positions and tokens are read).
    fn row_table(&self, positions: &[usize], tokens: &[u32]) -> B::Rows {
        let rows = positions.iter().zip(tokens).enumerate().map(|(i, (&pos, &token))| Row { seq: i, pos, token });
        self.b.rows(&Batch::new(rows.collect()).expect("rows of distinct sequences"))
    }

    /// Ingests committed target rows `(position, captured hidden [hidden_width])` into the
    /// rings. Call it for every committed position (prompt rows, accepted drafts, the anchor
    /// once the target has run it), never for rejected rows.
    pub fn commit(&self, ring: &mut Ring<B::T>, rows: &[(usize, &[f32])]) -> Result<(), DsparkError> {
        self.commit_batch(&mut [(ring, rows)])
    }

    /// [`Self::commit`] for several sequences in one pass (one `main_proj` product, one `wkv`
    /// product per stage).
    pub fn commit_batch(&self, seqs: &mut [CommitItem<'_, B::T>]) -> Result<(), DsparkError> {
        let w = self.hidden_width();
        let (hd, win) = (self.cfg.head_dim, self.cfg.window);
        let mut hidden = Vec::new();
        let mut positions = Vec::new();
        for (ring, rows) in seqs.iter() {
            if ring.n_stages() != self.n_stages() || ring.width() != hd || ring.window() != win {
                return Err(DsparkError::RingShape);
            }
            for (p, h) in rows.iter() {
                if h.len() != w {
                    return Err(DsparkError::HiddenWidth { expected: w, found: h.len() });
                }
                hidden.extend_from_slice(h);
                positions.push(*p);
            }
        }
        if positions.is_empty() {
            return Ok(());
        }
        let b = &self.b;
        let x = b.to_device(positions.len(), w, &hidden);
        let mx = self.main_x_t(&x);
        let rt = self.row_table(&positions, &vec![0; positions.len()]);
        let mut first = 0;
        let kv: Vec<B::T> = self
            .w
            .stages
            .iter()
            .map(|st| {
                let kv = b.matmul(&mx, &st.attn.wkv);
                let mut kv = b.rms_norm(&kv, Some(&st.attn.kv_norm), hd, self.cfg.rms_eps);
                b.rope(&mut kv, &rt, &self.freqs, hd, false);
                kv
            })
            .collect();
        for (ring, rows) in seqs.iter_mut() {
            // A later row of the same slot wins (as sequential writes would).
            let mut src = Vec::new();
            let mut dst = Vec::new();
            for (i, (p, _)) in rows.iter().enumerate() {
                if !rows[i + 1..].iter().any(|(q, _)| q % win == p % win) {
                    src.push(first + i);
                    dst.push(p % win);
                }
            }
            for (s, kv) in kv.iter().enumerate() {
                let part = b.select_rows(kv, &src);
                b.scatter_rows(ring.stage_tensor_mut(s), &part, &dst);
            }
            for (p, _) in rows.iter() {
                ring.set_tag(*p);
            }
            first += rows.len();
        }
        Ok(())
    }

    fn check(&self, r: &DraftRequest<B::T>) -> Result<(), DsparkError> {
        if r.anchor as usize >= self.cfg.vocab_size {
            return Err(DsparkError::Token { token: r.anchor, vocab: self.cfg.vocab_size });
        }
        let p = r.anchor_pos.checked_sub(1).ok_or(DsparkError::NoContext { pos: None, needed: 0 })?;
        let ring = r.ring;
        if ring.n_stages() != self.n_stages() || ring.width() != self.cfg.head_dim || ring.window() != self.cfg.window {
            return Err(DsparkError::RingShape);
        }
        if !ring.holds(p) {
            return Err(DsparkError::NoContext { pos: ring.last_pos(), needed: p });
        }
        Ok(())
    }

    /// DSparkAttention of stage `s` for the block rows `a [n·γ, d]` (row table `rt`), each
    /// block over its ring's `slots` plus every row of its own block (non-causal).
    fn attention(&self, s: usize, a: &B::T, reqs: &[DraftRequest<B::T>], slots: &[Vec<usize>], rt: &B::Rows) -> B::T {
        let (b, cfg) = (&self.b, &self.cfg);
        let aw = &self.w.stages[s].attn;
        let (h, hd, eps) = (cfg.n_heads, cfg.head_dim, cfg.rms_eps);
        // The target's ops for the same steps (forward.rs `attention`): the products of `a` as
        // one group, q_a's norm beside kv's norm + RoPE, the heads' norm + RoPE. Each result is
        // its separate ops' (the ops' contracts), in fewer launches where a backend fuses them.
        let mut pa = b.matmul_many(a, &[&aw.wq_a, &aw.wkv]).into_iter();
        let (q_a, kv_a) = (pa.next().expect("wq_a's product"), pa.next().expect("wkv's product"));
        let mut n1 = b
            .norms(
                vec![
                    NormJob::Norm { x: &q_a, w: Some(&aw.q_norm), group: cfg.q_lora_rank, eps, rope: false },
                    NormJob::Norm { x: &kv_a, w: Some(&aw.kv_norm), group: hd, eps, rope: true },
                ],
                rt,
                &self.freqs,
            )
            .into_iter();
        let (qr, kb) = (n1.next().expect("q_a's norm"), n1.next().expect("kv's norm"));
        let qh = b.matmul(&qr, &aw.wq_b);
        let q = b
            .norms(vec![NormJob::Norm { x: &qh, w: None, group: hd, eps, rope: true }], rt, &self.freqs)
            .pop()
            .expect("the heads' norm");
        let rings: Vec<&B::T> = reqs.iter().map(|r| r.ring.stage_tensor(s)).collect();
        let mut o = b.block_attention(&q, &kb, &rings, slots, &aw.sinks, h);
        b.rope(&mut o, rt, &self.freqs, hd, true);
        let z = b.grouped_matmul(&o, &aw.wo_a, cfg.o_groups);
        b.matmul(&z, &aw.wo_b)
    }

    /// Runs every block `[anchor, noise, …]` at positions `anchor_pos..anchor_pos+γ` through
    /// every stage and the head: returns `(h [n·γ, d], base_logits [n·γ, vocab])`, block `i` in
    /// rows `i·γ..(i+1)·γ`.
    fn block(&self, reqs: &[DraftRequest<B::T>], mut trace: Option<&mut Trace>) -> Result<(B::T, B::T), DsparkError> {
        for r in reqs {
            self.check(r)?;
        }
        let (b, cfg) = (&self.b, &self.cfg);
        let (g, d) = (self.dcfg.block_size, cfg.hidden);
        let mut positions = Vec::with_capacity(reqs.len() * g);
        let mut ids = Vec::with_capacity(reqs.len() * g);
        for r in reqs {
            positions.extend((0..g).map(|k| r.anchor_pos + k));
            ids.extend(std::iter::once(r.anchor).chain(std::iter::repeat_n(self.dcfg.noise_token_id, g - 1)));
        }
        let rows: Vec<Row> =
            positions.iter().zip(&ids).enumerate().map(|(i, (&pos, &token))| Row { seq: i / g, pos, token }).collect();
        let rt = b.rows(&Batch::new(rows).expect("one block per sequence"));
        let slots: Vec<Vec<usize>> = reqs.iter().map(|r| r.ring.visible(r.anchor_pos - 1)).collect();
        let e = b.embed(&self.w.embed, &rt);
        let mut x = b.hc_expand(&e, cfg.hc_mult);
        // Each stage as the target's layers run (forward.rs `sub_block`, `moe`): HC_PRE with its
        // norm, HC_POST that may start the next HC_PRE's sums, the router's product and choice;
        // each the values of the separate ops (hc_pre, rms_norm, hc_post, matmul, route).
        let stages = &self.w.stages;
        for (s, st) in stages.iter().enumerate() {
            let (_, a, post, comb) = b.hc_pre_norm(&x, &st.hc_attn, &st.attn_norm, cfg);
            let o = self.attention(s, &a, reqs, &slots, &rt);
            x = b.hc_post_next(&o, &x, &post, &comb, &st.hc_ffn, cfg);
            if let Some(tr) = trace.as_deref_mut() {
                tr.attn_out.push(b.to_host(&o));
            }

            let (_, f, post, comb) = b.hc_pre_norm(&x, &st.hc_ffn, &st.ffn_norm, cfg);
            let (_, route) = b.router(&f, &st.ffn.gate, Some(&st.ffn.bias), None, cfg);
            let (_, _, o) = b.moe_shared(&f, &route, &st.ffn.experts, 0, &st.ffn.shared, cfg.swiglu_limit);
            x = match stages.get(s + 1) {
                Some(next) => b.hc_post_next(&o, &x, &post, &comb, &next.hc_attn, cfg),
                None => b.hc_post(&o, &x, &post, &comb),
            };
            if let Some(tr) = trace.as_deref_mut() {
                tr.stage_out.push(b.to_host(&x));
            }
        }
        let h = b.hc_head(&x, &self.w.heads.hc_head, cfg);
        let hn = b.rms_norm(&h, Some(&self.w.heads.norm), d, cfg.rms_eps);
        let u = b.matmul(&hn, &self.w.head);
        if let Some(tr) = trace {
            tr.ring_slots = slots.into_iter().next().unwrap_or_default();
        }
        Ok((h, u))
    }

    /// The Markov loop over the blocks' base logits `u` and head hiddens `h` (rows `i·γ + k`):
    /// slot by slot, `Z_k = U_k + markov_w2 · markov_w1[prev]`, the confidence
    /// `conf · [h_k ; markov_w1[prev]]`, and the choice of `d_k`, for every sequence at once.
    ///
    /// Greedy choice runs as a row argmax on the backend whose ids stay there: the next slot's
    /// embedding reads them ([`Backend::embed_ids`]), so the loop queues all `γ` slots without
    /// waiting. The confidence does not steer the loop, so its two products run once over every
    /// slot after it (`conf_h · h` over the `n·γ` rows, `conf_e` over the slots' embeddings
    /// gathered again), and the tokens and both halves come back in three downloads; their sum
    /// is the f32 add [`Backend::add`] did. (Until v41 each slot downloaded its ids and uploaded
    /// them again, `γ` host round trips a draft, and formed its confidence in four launches.)
    /// Sampling, and greedy drafts that return their logits, bring each slot's `Z` rows to the
    /// host.
    fn heads<R: Rng + ?Sized>(
        &self,
        reqs: &[DraftRequest<B::T>],
        h: &B::T,
        u: &B::T,
        mut choice: Choice<'_, R>,
        mut trace: Option<&mut Trace>,
    ) -> Vec<Draft> {
        let b = &self.b;
        let (n, g, v) = (reqs.len(), self.dcfg.block_size, self.cfg.vocab_size);
        let anchors: Vec<u32> = reqs.iter().map(|r| r.anchor).collect();
        let anchors = b.upload_ids(&anchors);
        // Each slot's chosen ids, on the backend.
        let mut chosen: Vec<B::Ids> = Vec::with_capacity(g);
        let mut out: Vec<Draft> = (0..n)
            .map(|_| Draft {
                tokens: Vec::with_capacity(g),
                logits: Vec::new(),
                q_probs: None,
                conf_raw: Vec::new(),
                vocab: v,
            })
            .collect();
        for k in 0..g {
            let sel: Vec<usize> = (0..n).map(|i| i * g + k).collect();
            let prev = chosen.last().unwrap_or(&anchors);
            // Greedy ids alone: the slot as one backend op (fused where the backend can).
            if trace.is_none() && matches!(choice, Choice::Greedy { with_logits: false }) {
                chosen.push(b.markov_argmax(u, &sel, prev, &self.w.heads.markov_w1, &self.w.heads.markov_w2));
                continue;
            }
            let uk = b.select_rows(u, &sel);
            let e = b.embed_ids(&self.w.heads.markov_w1, prev);
            let bias = b.matmul(&e, &self.w.heads.markov_w2);
            let z = b.add(&uk, &bias);
            if let Some(tr) = trace.as_deref_mut() {
                tr.markov_prev.extend(b.ids_to_host(prev));
                tr.markov_embed.extend(b.to_host(&e));
                tr.markov_bias.extend(b.to_host(&bias));
            }
            let tokens = match &mut choice {
                Choice::Greedy { with_logits } => {
                    if *with_logits {
                        let zh = b.to_host(&z);
                        for (i, d) in out.iter_mut().enumerate() {
                            d.logits.extend_from_slice(&zh[i * v..(i + 1) * v]);
                        }
                    }
                    b.argmax_ids(&z)
                }
                Choice::Sampled { temperature, rng } => {
                    let zh = b.to_host(&z);
                    let tokens: Vec<u32> = (0..n)
                        .map(|i| {
                            let zi = &zh[i * v..(i + 1) * v];
                            let d = &mut out[i];
                            d.logits.extend_from_slice(zi);
                            let q = d.q_probs.get_or_insert_with(|| Vec::with_capacity(g * v));
                            let at = q.len();
                            q.resize(at + v, 0.0);
                            softmax_into(zi, *temperature, &mut q[at..]);
                            sample(&q[at..], &mut **rng) as u32
                        })
                        .collect();
                    b.upload_ids(&tokens)
                }
            };
            chosen.push(tokens);
        }
        // The confidence's halves: rows i·γ + k of `ch`, k·n + i of `ce` (slot k's embedding
        // reads the ids chosen before it: the anchors, then slots 0..γ−1).
        // All three queued before the first download, so that only that one waits on the loop.
        let ch = b.matmul(h, &self.w.heads.conf_h);
        let mut prevs: Vec<&B::Ids> = vec![&anchors];
        prevs.extend(chosen.iter().take(g.saturating_sub(1)));
        let e_all = b.embed_ids(&self.w.heads.markov_w1, &b.concat_ids(&prevs));
        let ce = b.matmul(&e_all, &self.w.heads.conf_e);
        let refs: Vec<&B::Ids> = chosen.iter().collect();
        let tokens = b.concat_ids(&refs);
        let (ch, ce, tokens) = (b.to_host(&ch), b.to_host(&ce), b.ids_to_host(&tokens));
        for k in 0..g {
            for (i, d) in out.iter_mut().enumerate() {
                d.tokens.push(tokens[k * n + i]);
                d.conf_raw.push(ch[i * g + k] + ce[k * n + i]);
            }
        }
        out
    }

    /// Drafts a block after the anchor `anchor` at `anchor_pos` (= P+1; the ring must hold
    /// position P). Greedy (first maximum) at `temperature <= 0`; otherwise each slot samples
    /// from `softmax(Z_k / T)` with `rng`, left to right, and the distributions are returned.
    pub fn draft<R: Rng + ?Sized>(
        &self,
        ring: &Ring<B::T>,
        anchor: u32,
        anchor_pos: usize,
        temperature: f32,
        rng: &mut R,
    ) -> Result<Draft, DsparkError> {
        self.draft_inner(ring, anchor, anchor_pos, temperature, rng, None)
    }

    /// [`Drafter::draft`] that also returns the block's intermediates.
    pub fn draft_traced<R: Rng + ?Sized>(
        &self,
        ring: &Ring<B::T>,
        anchor: u32,
        anchor_pos: usize,
        temperature: f32,
        rng: &mut R,
    ) -> Result<(Draft, Trace), DsparkError> {
        let mut tr = Trace::default();
        let d = self.draft_inner(ring, anchor, anchor_pos, temperature, rng, Some(&mut tr))?;
        Ok((d, tr))
    }

    fn draft_inner<R: Rng + ?Sized>(
        &self,
        ring: &Ring<B::T>,
        anchor: u32,
        anchor_pos: usize,
        temperature: f32,
        rng: &mut R,
        mut trace: Option<&mut Trace>,
    ) -> Result<Draft, DsparkError> {
        let reqs = [DraftRequest { ring, anchor, anchor_pos }];
        let (h, u) = self.block(&reqs, trace.as_deref_mut())?;
        let greedy = temperature <= 0.0 || !temperature.is_finite();
        let choice = if greedy { Choice::Greedy { with_logits: true } } else { Choice::Sampled { temperature, rng } };
        let d = self.heads(&reqs, &h, &u, choice, trace.as_deref_mut()).pop().expect("one draft");
        if let Some(tr) = trace {
            tr.h = self.b.to_host(&h);
            tr.base_logits = self.b.to_host(&u);
        }
        Ok(d)
    }

    /// The blocks' forward through every stage and the LM head, without the Markov loop
    /// (benchmarks: the loop's cost is [`Self::draft_batch`]'s minus this). Waits for the
    /// backend (one `[n·γ]` argmax comes back).
    pub fn block_only(&self, reqs: &[DraftRequest<B::T>]) -> Result<(), DsparkError> {
        let (_, u) = self.block(reqs, None)?;
        self.b.argmax_rows(&u);
        Ok(())
    }

    /// Greedy drafts of several sequences in one batched forward (the rows of all blocks go
    /// through each stage together). `with_logits`: also return each block's `Z` rows
    /// (`γ · vocab` floats per sequence come back to the host).
    pub fn draft_batch(&self, reqs: &[DraftRequest<B::T>], with_logits: bool) -> Result<Vec<Draft>, DsparkError> {
        if reqs.is_empty() {
            return Ok(Vec::new());
        }
        let (h, u) = self.block(reqs, None)?;
        Ok(self.heads::<dyn rand::RngCore>(reqs, &h, &u, Choice::Greedy { with_logits }, None))
    }
}

/// `out = softmax(z / t)` (computed in f64).
pub fn softmax_into(z: &[f32], t: f32, out: &mut [f32]) {
    let t = t as f64;
    let m = z.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = z.iter().map(|&x| ((x as f64 - m) / t).exp()).collect();
    let s: f64 = e.iter().sum();
    out.iter_mut().zip(&e).for_each(|(o, x)| *o = (x / s) as f32);
}

/// Draws an index from the probabilities `p` (they need not sum exactly to 1).
pub fn sample<R: Rng + ?Sized>(p: &[f32], rng: &mut R) -> usize {
    let total: f64 = p.iter().map(|&x| x as f64).sum();
    let u = rng.gen::<f64>() * total;
    let mut acc = 0f64;
    let mut last = 0;
    for (i, &x) in p.iter().enumerate() {
        if x > 0.0 {
            acc += x as f64;
            last = i;
            if u < acc {
                return i;
            }
        }
    }
    last
}
