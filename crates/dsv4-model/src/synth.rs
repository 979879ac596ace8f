//! Random DeepSeek V4 checkpoints in HF layout, for `init-tiny`, tests and benchmarks.
//!
//! Every parameter is randomised the way `shared/reference/dsv4_reference.py` does it (HF's own
//! init zeroes sinks, position biases and the mHC base, which would hide bugs).

use crate::config::{AttnKind, Config};
use crate::store::DType;
use crate::weights::hf_name;

/// A tensor ready for [`crate::store::write_safetensors`].
pub type RawTensor = (String, DType, Vec<usize>, Vec<u8>);

/// splitmix64 + Box–Muller: reproducible without pulling a RNG crate into the model crate.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f32 {
        let (u1, u2) = (self.uniform(), self.uniform());
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
}

/// Element encoding of the written weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SynthDType {
    F32,
    BF16,
}

struct Gen {
    rng: Rng,
    dtype: SynthDType,
    out: Vec<RawTensor>,
}

impl Gen {
    fn push(&mut self, name: String, shape: Vec<usize>, v: Vec<f32>, keep_f32: bool) {
        let (dt, bytes) = if keep_f32 || self.dtype == SynthDType::F32 {
            (DType::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect())
        } else {
            (DType::BF16, v.iter().flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes()).collect())
        };
        self.out.push((name, dt, shape, bytes));
    }
    fn normal(&mut self, n: usize, mean: f32, std: f32) -> Vec<f32> {
        (0..n).map(|_| mean + std * self.rng.normal()).collect()
    }
    /// A `[rows, cols]` matrix with std `cols^-1/2` (unit-variance outputs).
    fn matrix(&mut self, name: String, rows: usize, cols: usize) {
        let v = self.normal(rows * cols, 0.0, (cols as f32).powf(-0.5));
        self.push(name, vec![rows, cols], v, false);
    }
    fn vector(&mut self, name: String, n: usize, mean: f32, std: f32) {
        let v = self.normal(n, mean, std);
        self.push(name, vec![n], v, true);
    }
    /// mHC parameters; `names` are the (fn, base, scale) suffixes after `p`.
    fn hc(&mut self, p: &str, rows: usize, width: usize, names: [&str; 3], nscale: usize) {
        self.matrix(format!("{p}{}", names[0]), rows, width);
        self.vector(format!("{p}{}", names[1]), rows, 0.0, 0.5);
        self.vector(format!("{p}{}", names[2]), nscale, 1.0, 0.2);
    }
    /// The parts every decoder block shares (mHC for both halves, the two norms, the attention's
    /// query, KV, output projections and sinks), named `p.<official name>` and passed through
    /// `name` (official names for the drafter, HF names for the target).
    fn block_head(&mut self, p: &str, cfg: &Config, name: &dyn Fn(&str) -> String) {
        let (d, hd, h) = (cfg.hidden, cfg.head_dim, cfg.n_heads);
        let n = |s: &str| name(&format!("{p}.{s}"));
        for half in ["attn", "ffn"] {
            self.matrix(n(&format!("hc_{half}_fn")), cfg.hc_mix(), cfg.hc_width());
            self.vector(n(&format!("hc_{half}_base")), cfg.hc_mix(), 0.0, 0.5);
            self.vector(n(&format!("hc_{half}_scale")), 3, 1.0, 0.2);
        }
        self.vector(n("attn_norm.weight"), d, 1.0, 0.1);
        self.vector(n("ffn_norm.weight"), d, 1.0, 0.1);
        self.matrix(n("attn.wq_a.weight"), cfg.q_lora_rank, d);
        self.vector(n("attn.q_norm.weight"), cfg.q_lora_rank, 1.0, 0.1);
        self.matrix(n("attn.wq_b.weight"), h * hd, cfg.q_lora_rank);
        self.matrix(n("attn.wkv.weight"), hd, d);
        self.vector(n("attn.kv_norm.weight"), hd, 1.0, 0.1);
        self.matrix(n("attn.wo_a.weight"), cfg.o_groups * cfg.o_lora_rank, h * hd / cfg.o_groups);
        self.matrix(n("attn.wo_b.weight"), d, cfg.o_groups * cfg.o_lora_rank);
        self.vector(n("attn.attn_sink"), h, 0.0, 1.0);
    }
    fn compressor(&mut self, p: &str, width: usize, d: usize, ratio: usize, head: usize) {
        self.matrix(format!("{p}.kv_proj.weight"), width, d);
        self.matrix(format!("{p}.gate_proj.weight"), width, d);
        let ape = self.normal(ratio * width, 0.0, 0.5);
        self.push(format!("{p}.position_bias"), vec![ratio, width], ape, true);
        self.vector(format!("{p}.kv_norm.weight"), head, 1.0, 0.1);
    }
}

/// All tensors of a random model with HF `save_pretrained` names, in load order.
pub fn random_checkpoint(cfg: &Config, seed: u64, dtype: SynthDType) -> Vec<RawTensor> {
    let mut g = Gen { rng: Rng(seed ^ 0x5EED_D5F4), dtype, out: Vec::new() };
    let (d, hd) = (cfg.hidden, cfg.head_dim);
    let embed = g.normal(cfg.vocab_size * d, 0.0, 1.0);
    g.push("model.embed_tokens.weight".into(), vec![cfg.vocab_size, d], embed, false);
    for (l, spec) in cfg.layers.iter().enumerate() {
        let p = format!("model.layers.{l}");
        g.block_head(&format!("layers.{l}"), cfg, &hf_name);
        let a = format!("{p}.self_attn");
        match spec.attn {
            AttnKind::Swa => {}
            AttnKind::Hca => g.compressor(&format!("{a}.compressor"), hd, d, spec.ratio, hd),
            AttnKind::Csa => {
                g.compressor(&format!("{a}.compressor"), 2 * hd, d, spec.ratio, hd);
                let ix = format!("{a}.compressor.indexer");
                g.compressor(&ix, 2 * cfg.index_head_dim, d, spec.ratio, cfg.index_head_dim);
                g.matrix(format!("{ix}.q_b_proj.weight"), cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank);
                g.matrix(format!("{ix}.scorer.weights_proj.weight"), cfg.index_n_heads, d);
            }
        }
        let m = format!("{p}.mlp");
        let (ne, k, inter) = (cfg.n_routed_experts, cfg.n_experts_per_tok, cfg.moe_inter);
        g.matrix(format!("{m}.gate.weight"), ne, d);
        if spec.hash_moe {
            let mut ids = Vec::with_capacity(cfg.vocab_size * k);
            for _ in 0..cfg.vocab_size {
                let mut perm: Vec<i64> = (0..ne as i64).collect();
                for i in 0..k {
                    let j = i + (g.rng.next_u64() % (ne - i) as u64) as usize;
                    perm.swap(i, j);
                }
                ids.extend_from_slice(&perm[..k]);
            }
            let bytes = ids.iter().flat_map(|x| x.to_le_bytes()).collect();
            g.out.push((format!("{m}.gate.tid2eid"), DType::I64, vec![cfg.vocab_size, k], bytes));
        } else {
            g.vector(format!("{m}.gate.e_score_correction_bias"), ne, 0.0, 0.1);
        }
        let gu = g.normal(ne * 2 * inter * d, 0.0, (d as f32).powf(-0.5));
        g.push(format!("{m}.experts.gate_up_proj"), vec![ne, 2 * inter, d], gu, false);
        let dn = g.normal(ne * d * inter, 0.0, (inter as f32).powf(-0.5));
        g.push(format!("{m}.experts.down_proj"), vec![ne, d, inter], dn, false);
        g.matrix(format!("{m}.shared_experts.gate_proj.weight"), inter, d);
        g.matrix(format!("{m}.shared_experts.up_proj.weight"), inter, d);
        g.matrix(format!("{m}.shared_experts.down_proj.weight"), d, inter);
    }
    g.vector("model.norm.weight".into(), d, 1.0, 0.1);
    g.hc("model.hc_head.", cfg.hc_mult, cfg.hc_width(), ["hc_fn", "hc_base", "hc_scale"], 1);
    g.matrix("lm_head.weight".into(), cfg.vocab_size, d);
    g.out
}

/// The `dspark_*` settings of a random DSpark drafter (see [`random_dspark`]).
#[derive(Clone, Debug)]
pub struct SynthDspark {
    pub stages: usize,
    pub block_size: usize,
    pub noise_token_id: u32,
    pub target_layer_ids: Vec<usize>,
    pub markov_rank: usize,
}

impl SynthDspark {
    /// Three stages, γ = 5, capturing the last three target layers (as V4's DSpark drafters),
    /// noise token = the last vocabulary id.
    pub fn for_config(cfg: &Config) -> Self {
        let n = cfg.n_layers();
        SynthDspark {
            stages: 3,
            block_size: 5,
            noise_token_id: (cfg.vocab_size - 1) as u32,
            target_layer_ids: (n.saturating_sub(3)..n).collect(),
            markov_rank: 8,
        }
    }

    /// The `dspark_*` keys to merge into `config.json` (either layout).
    pub fn json_keys(&self) -> Vec<(&'static str, serde_json::Value)> {
        vec![
            ("dspark_block_size", self.block_size.into()),
            ("dspark_noise_token_id", self.noise_token_id.into()),
            ("dspark_target_layer_ids", self.target_layer_ids.clone().into()),
            ("dspark_markov_rank", self.markov_rank.into()),
        ]
    }
}

/// Random DSpark drafter tensors `mtp.<s>.*` with the official names (spec `dspark.md` §3.7),
/// randomised like [`random_checkpoint`]. The embedding and LM head are not written: the drafter
/// shares the target's (`model.embed_tokens.weight`, `lm_head.weight`).
pub fn random_dspark(cfg: &Config, ds: &SynthDspark, seed: u64, dtype: SynthDType) -> Vec<RawTensor> {
    let mut g = Gen { rng: Rng(seed ^ 0xD59A_2C0F), dtype, out: Vec::new() };
    let (d, v) = (cfg.hidden, cfg.vocab_size);
    let ncap = ds.target_layer_ids.len();
    g.matrix("mtp.0.main_proj.weight".into(), d, ncap * d);
    g.vector("mtp.0.main_norm.weight".into(), d, 1.0, 0.1);
    for s in 0..ds.stages {
        let p = format!("mtp.{s}");
        g.block_head(&p, cfg, &|n: &str| n.to_string());
        let f = format!("{p}.ffn");
        let (ne, inter) = (cfg.n_routed_experts, cfg.moe_inter);
        g.matrix(format!("{f}.gate.weight"), ne, d);
        g.vector(format!("{f}.gate.bias"), ne, 0.0, 0.1);
        for e in (0..ne).map(|e| format!("{f}.experts.{e}")).chain([format!("{f}.shared_experts")]) {
            g.matrix(format!("{e}.w1.weight"), inter, d);
            g.matrix(format!("{e}.w2.weight"), d, inter);
            g.matrix(format!("{e}.w3.weight"), inter, d);
        }
    }
    let p = format!("mtp.{}", ds.stages - 1);
    g.vector(format!("{p}.norm.weight"), d, 1.0, 0.1);
    g.hc(&p, cfg.hc_mult, cfg.hc_width(), [".hc_head_fn", ".hc_head_base", ".hc_head_scale"], 1);
    g.matrix(format!("{p}.markov_head.markov_w1.weight"), v, ds.markov_rank);
    g.matrix(format!("{p}.markov_head.markov_w2.weight"), v, ds.markov_rank);
    g.matrix(format!("{p}.confidence_head.proj.weight"), 1, d + ds.markov_rank);
    g.out
}

/// The tiny configuration of spec §12.1 (every layer type, hash and learned routing, active
/// clamp, YaRN), with the given vocabulary size.
pub fn tiny_config(vocab_size: usize) -> Config {
    use crate::config::{LayerSpec, Yarn};
    let kinds = [
        (AttnKind::Swa, 0),
        (AttnKind::Csa, 4),
        (AttnKind::Hca, 8),
        (AttnKind::Csa, 4),
        (AttnKind::Hca, 8),
        (AttnKind::Swa, 0),
    ];
    Config {
        vocab_size,
        hidden: 64,
        n_heads: 4,
        head_dim: 32,
        rope_dim: 8,
        q_lora_rank: 24,
        o_groups: 2,
        o_lora_rank: 16,
        window: 8,
        index_n_heads: 4,
        index_head_dim: 16,
        index_topk: 2,
        n_routed_experts: 8,
        n_experts_per_tok: 2,
        moe_inter: 16,
        swiglu_limit: 2.0,
        yarn: Some(Yarn { factor: 4.0, original_max_position: 16.0, beta_fast: 32.0, beta_slow: 1.0 }),
        n_mtp_layers: 0,
        layers: kinds
            .iter()
            .enumerate()
            .map(|(i, &(attn, ratio))| LayerSpec { attn, ratio, hash_moe: i < 3 })
            .collect(),
        ..Config::flash()
    }
}
