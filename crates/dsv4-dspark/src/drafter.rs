//! The DSpark drafter on the CPU (f32): context fusion, ring writes, the non-causal block
//! through the draft stages, and the Markov/confidence heads (spec §3.3–§3.6).

use std::path::Path;

use dsv4_backend::cpu::attention::rope_vec;
use dsv4_backend::cpu::linalg::{dot, rms_norm};
use dsv4_backend::cpu::{CpuBackend, Tensor};
use dsv4_backend::Backend;
use dsv4_model::{AttnKind, Config, LoadError, TensorStore};
use rand::Rng;

use crate::ring::ContextRing;
use crate::weights::{self, DrafterWeights};
use crate::{DsparkConfig, DsparkError};

/// One drafted block.
#[derive(Clone, Debug, PartialEq)]
pub struct Draft {
    /// `tokens[k]` is the draft for position `anchor_pos + 1 + k` (γ tokens).
    pub tokens: Vec<u32>,
    /// The Markov-corrected logits `Z_k` the tokens were chosen from, `[γ, vocab]`.
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

/// The first index of the maximum (torch's argmax).
pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// Sink-softmax attention in which every query row sees every key (the non-causal block):
/// `q [rows, heads·hd]`, `keys` each `hd` wide (K = V), `sinks [heads]` enter the denominator
/// only; scale `hd^-½`. Returns `[rows, heads·hd]`.
pub fn block_attention(q: &[f32], heads: usize, hd: usize, keys: &[&[f32]], sinks: &[f32]) -> Vec<f32> {
    let rows = q.len() / (heads * hd);
    let scale = (hd as f32).powf(-0.5);
    let mut out = vec![0f32; rows * heads * hd];
    let mut sc = vec![0f32; keys.len()];
    for t in 0..rows {
        for h in 0..heads {
            let qh = &q[(t * heads + h) * hd..(t * heads + h + 1) * hd];
            for (s, k) in sc.iter_mut().zip(keys) {
                *s = dot(qh, k) * scale;
            }
            let m = sc.iter().copied().fold(sinks[h], f32::max);
            let mut den = (sinks[h] - m).exp();
            for s in sc.iter_mut() {
                *s = (*s - m).exp();
                den += *s;
            }
            let oh = &mut out[(t * heads + h) * hd..(t * heads + h + 1) * hd];
            for (s, k) in sc.iter().zip(keys) {
                let p = s / den;
                for (a, b) in oh.iter_mut().zip(k.iter()) {
                    *a += p * b;
                }
            }
        }
    }
    out
}

/// The DSpark drafter: weights plus the target config they belong to. Stateless; the
/// per-sequence state is a [`ContextRing`].
pub struct Drafter {
    cfg: Config,
    dcfg: DsparkConfig,
    w: DrafterWeights,
    /// RoPE of the stages: plain `rope_theta`, no YaRN (ratio-0 layers).
    freqs: Vec<f64>,
    b: CpuBackend,
}

impl Drafter {
    /// Loads the drafter of a checkpoint: `store` holds the target and `mtp.<s>.*` tensors,
    /// `cfg` is the target's config.
    pub fn load(store: &TensorStore, cfg: &Config, dcfg: &DsparkConfig) -> Result<Self, DsparkError> {
        let w = weights::load(store, cfg, dcfg)?;
        Ok(Self::from_weights(cfg.clone(), dcfg.clone(), w))
    }

    /// Loads from a checkpoint directory (`config.json` in either layout with the `dspark_*`
    /// keys, plus safetensors).
    pub fn load_dir(dir: &Path) -> Result<Self, DsparkError> {
        let cfg = Config::from_dir(dir).map_err(LoadError::from)?;
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|source| LoadError::Io { path: path.display().to_string(), source })?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| DsparkError::Config { field: "config.json".into(), msg: e.to_string() })?;
        let dcfg = DsparkConfig::from_json(&v, cfg.n_layers(), cfg.vocab_size)?
            .ok_or_else(|| DsparkError::NotDspark("config.json has no `dspark_block_size`".into()))?;
        let store = TensorStore::open(dir)?;
        Self::load(&store, &cfg, &dcfg)
    }

    pub fn from_weights(cfg: Config, dcfg: DsparkConfig, w: DrafterWeights) -> Self {
        let freqs = cfg.rope_freqs(AttnKind::Swa);
        Drafter { cfg, dcfg, w, freqs, b: CpuBackend }
    }

    pub fn config(&self) -> &DsparkConfig {
        &self.dcfg
    }

    pub fn target_config(&self) -> &Config {
        &self.cfg
    }

    pub fn weights(&self) -> &DrafterWeights {
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

    /// A fresh (empty) per-sequence state: one ring of `window` rows per stage.
    pub fn new_ring(&self) -> ContextRing {
        ContextRing::new(self.n_stages(), self.cfg.window, self.cfg.head_dim)
    }

    /// `main_x = main_norm(main_proj · main_hidden)` for `[rows, hidden_width]` captured rows.
    pub fn main_x(&self, hidden: &[f32]) -> Result<Vec<f32>, DsparkError> {
        let w = self.hidden_width();
        if !hidden.len().is_multiple_of(w) {
            return Err(DsparkError::HiddenWidth { expected: w, found: hidden.len() });
        }
        let x = Tensor::new(hidden.len() / w, w, hidden.to_vec());
        let y = self.b.matmul(&x, &self.w.main_proj);
        Ok(rms_norm(&y.data, self.cfg.hidden, Some(&self.w.main_norm.data), self.cfg.rms_eps))
    }

    /// The ring rows of every stage for `main_x [rows, d]` at `positions`:
    /// `RoPE_pos(kv_norm_s(wkv_s · main_x))`, `[stages][rows, head_dim]`.
    pub fn context_rows(&self, main_x: &[f32], positions: &[usize]) -> Vec<Vec<f32>> {
        let x = Tensor::new(positions.len(), self.cfg.hidden, main_x.to_vec());
        let hd = self.cfg.head_dim;
        self.w
            .stages
            .iter()
            .map(|st| {
                let kv = self.b.matmul(&x, &st.attn.wkv);
                let mut kv = rms_norm(&kv.data, hd, Some(&st.attn.kv_norm.data), self.cfg.rms_eps);
                for (row, &p) in kv.chunks_mut(hd).zip(positions) {
                    rope_vec(row, p, &self.freqs, false);
                }
                kv
            })
            .collect()
    }

    /// Ingests committed target rows `(position, captured hidden [hidden_width])` into the
    /// rings. Call it for every committed position (prompt rows, accepted drafts, the anchor
    /// once the target has run it), never for rejected rows.
    pub fn commit(&self, ring: &mut ContextRing, rows: &[(usize, &[f32])]) -> Result<(), DsparkError> {
        if rows.is_empty() {
            return Ok(());
        }
        let w = self.hidden_width();
        let mut hidden = Vec::with_capacity(rows.len() * w);
        for (_, h) in rows {
            if h.len() != w {
                return Err(DsparkError::HiddenWidth { expected: w, found: h.len() });
            }
            hidden.extend_from_slice(h);
        }
        let positions: Vec<usize> = rows.iter().map(|r| r.0).collect();
        let mx = self.main_x(&hidden)?;
        let kv = self.context_rows(&mx, &positions);
        let hd = self.cfg.head_dim;
        for (i, &p) in positions.iter().enumerate() {
            let per_stage: Vec<&[f32]> = kv.iter().map(|k| &k[i * hd..(i + 1) * hd]).collect();
            ring.write(p, &per_stage);
        }
        Ok(())
    }

    /// `markov_w1[prev]` (`[r]`).
    pub fn markov_embed(&self, prev: u32) -> &[f32] {
        self.w.heads.markov_w1.row(prev as usize)
    }

    /// The Markov bias for a previous token: `markov_w2 · markov_w1[prev]` (`[vocab]`).
    pub fn markov_bias(&self, prev: u32) -> Vec<f32> {
        let e = self.markov_embed(prev);
        let w2 = &self.w.heads.markov_w2;
        (0..w2.rows).map(|v| dot(w2.row(v), e)).collect()
    }

    /// The confidence head's raw logit for a pre-norm head hidden `h [d]` and previous token.
    pub fn confidence_raw(&self, h: &[f32], prev: u32) -> f32 {
        let wc = &self.w.heads.conf.data;
        let d = self.cfg.hidden;
        dot(&wc[..d], h) + dot(&wc[d..], self.markov_embed(prev))
    }

    fn check_token(&self, t: u32) -> Result<(), DsparkError> {
        if t as usize >= self.cfg.vocab_size {
            return Err(DsparkError::Token { token: t, vocab: self.cfg.vocab_size });
        }
        Ok(())
    }

    /// DSparkAttention of stage `s` for the block rows `a [γ, d]` at `positions`, over the
    /// ring slots `slots` plus every block row (non-causal).
    fn attention(&self, s: usize, a: &Tensor, ring: &ContextRing, slots: &[usize], positions: &[usize]) -> Tensor {
        let (b, cfg) = (&self.b, &self.cfg);
        let aw = &self.w.stages[s].attn;
        let (h, hd, eps) = (cfg.n_heads, cfg.head_dim, cfg.rms_eps);
        let qr = b.rms_norm(&b.matmul(a, &aw.wq_a), Some(&aw.q_norm), cfg.q_lora_rank, eps);
        let mut q = b.rms_norm(&b.matmul(&qr, &aw.wq_b), None, hd, eps);
        let mut kb = b.rms_norm(&b.matmul(a, &aw.wkv), Some(&aw.kv_norm), hd, eps);
        for (k, &p) in positions.iter().enumerate() {
            for head in q.data[k * h * hd..(k + 1) * h * hd].chunks_mut(hd) {
                rope_vec(head, p, &self.freqs, false);
            }
            rope_vec(&mut kb.data[k * hd..(k + 1) * hd], p, &self.freqs, false);
        }
        let mut keys: Vec<&[f32]> = slots.iter().map(|&sl| ring.row(s, sl)).collect();
        keys.extend((0..positions.len()).map(|k| kb.row(k)));
        let mut o = block_attention(&q.data, h, hd, &keys, &aw.sinks.data);
        for (k, &p) in positions.iter().enumerate() {
            for head in o[k * h * hd..(k + 1) * h * hd].chunks_mut(hd) {
                rope_vec(head, p, &self.freqs, true);
            }
        }
        let o = Tensor::new(positions.len(), h * hd, o);
        let z = b.grouped_matmul(&o, &aw.wo_a, cfg.o_groups);
        b.matmul(&z, &aw.wo_b)
    }

    /// Runs the block `[anchor, noise, …]` at positions `anchor_pos..anchor_pos+γ` through every
    /// stage and the head: returns `(h [γ, d], base_logits [γ, vocab])`.
    fn block(
        &self,
        ring: &ContextRing,
        anchor: u32,
        anchor_pos: usize,
        trace: &mut Trace,
    ) -> Result<(Tensor, Tensor), DsparkError> {
        self.check_token(anchor)?;
        let p = anchor_pos.checked_sub(1).ok_or(DsparkError::NoContext { pos: None, needed: 0 })?;
        if ring.n_stages() != self.n_stages() || ring.width() != self.cfg.head_dim {
            return Err(DsparkError::RingShape);
        }
        if !ring.holds(p) {
            return Err(DsparkError::NoContext { pos: ring.last_pos(), needed: p });
        }
        let (b, cfg) = (&self.b, &self.cfg);
        let (g, d) = (self.dcfg.block_size, cfg.hidden);
        let ids: Vec<u32> =
            std::iter::once(anchor).chain(std::iter::repeat_n(self.dcfg.noise_token_id, g - 1)).collect();
        let positions: Vec<usize> = (0..g).map(|k| anchor_pos + k).collect();
        let slots = ring.visible(p);
        let e = Tensor::new(g, d, ids.iter().flat_map(|&t| self.w.embed.row(t as usize).iter().copied()).collect());
        let mut x = b.hc_expand(&e, cfg.hc_mult);
        for (s, st) in self.w.stages.iter().enumerate() {
            let (y, post, comb) = b.hc_pre(&x, &st.hc_attn, cfg);
            let a = b.rms_norm(&y, Some(&st.attn_norm), d, cfg.rms_eps);
            let o = self.attention(s, &a, ring, &slots, &positions);
            x = b.hc_post(&o, &x, &post, &comb);
            trace.attn_out.push(o.data);

            let (y, post, comb) = b.hc_pre(&x, &st.hc_ffn, cfg);
            let f = b.rms_norm(&y, Some(&st.ffn_norm), d, cfg.rms_eps);
            let logits = b.matmul(&f, &st.ffn.gate);
            let route = b.route(&logits, Some(&st.ffn.bias), None, cfg);
            let routed = b.moe(&f, &route, &st.ffn.experts, cfg.swiglu_limit);
            let shared = b.swiglu(&f, &st.ffn.shared, cfg.swiglu_limit);
            let o = b.add(&routed, &shared);
            x = b.hc_post(&o, &x, &post, &comb);
            trace.stage_out.push(x.data.clone());
        }
        let h = b.hc_head(&x, &self.w.heads.hc_head, cfg);
        let hn = b.rms_norm(&h, Some(&self.w.heads.norm), d, cfg.rms_eps);
        let u = b.matmul(&hn, &self.w.head);
        trace.ring_slots = slots;
        Ok((h, u))
    }

    /// Drafts a block after the anchor `anchor` at `anchor_pos` (= P+1; the ring must hold
    /// position P). Greedy (first maximum) at `temperature <= 0`; otherwise each slot samples
    /// from `softmax(Z_k / T)` with `rng`, left to right, and the distributions are returned.
    pub fn draft<R: Rng + ?Sized>(
        &self,
        ring: &ContextRing,
        anchor: u32,
        anchor_pos: usize,
        temperature: f32,
        rng: &mut R,
    ) -> Result<Draft, DsparkError> {
        self.draft_traced(ring, anchor, anchor_pos, temperature, rng).map(|(d, _)| d)
    }

    /// [`Drafter::draft`] that also returns the block's intermediates.
    pub fn draft_traced<R: Rng + ?Sized>(
        &self,
        ring: &ContextRing,
        anchor: u32,
        anchor_pos: usize,
        temperature: f32,
        rng: &mut R,
    ) -> Result<(Draft, Trace), DsparkError> {
        let mut tr = Trace::default();
        let (h, u) = self.block(ring, anchor, anchor_pos, &mut tr)?;
        let (g, v, r) = (self.dcfg.block_size, self.cfg.vocab_size, self.dcfg.markov_rank);
        let greedy = temperature <= 0.0 || !temperature.is_finite();
        let mut logits = u.data.clone();
        let mut q = (!greedy).then(|| vec![0f32; g * v]);
        let (mut tokens, mut conf) = (Vec::with_capacity(g), Vec::with_capacity(g));
        tr.markov_embed.reserve(g * r);
        let mut prev = anchor;
        for k in 0..g {
            let bias = self.markov_bias(prev);
            let z = &mut logits[k * v..(k + 1) * v];
            z.iter_mut().zip(&bias).for_each(|(a, b)| *a += b);
            conf.push(self.confidence_raw(h.row(k), prev));
            tr.markov_prev.push(prev);
            tr.markov_embed.extend_from_slice(self.markov_embed(prev));
            tr.markov_bias.extend(bias);
            let t = match q.as_mut() {
                None => argmax(z),
                Some(q) => {
                    let qk = &mut q[k * v..(k + 1) * v];
                    softmax_into(z, temperature, qk);
                    sample(qk, rng)
                }
            } as u32;
            tokens.push(t);
            prev = t;
        }
        tr.h = h.data;
        tr.base_logits = u.data;
        Ok((Draft { tokens, logits, q_probs: q, conf_raw: conf, vocab: v }, tr))
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
