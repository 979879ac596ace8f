//! The model configuration of GGUFs that carry no `dsv4.config_json`: antirez/ds4's files.
//!
//! ds4 (`ds4.c` at `8d57664`, `config_validate_model`) requires these `deepseek4.*` keys and checks
//! them against its hard-coded V4-Flash shape ("Fixed DeepSeek V4 Flash Shape": 43 layers, hidden
//! 4096, ...): `block_count`, `embedding_length`, `vocab_size`, `context_length` (read for the
//! summary only); `attention.{head_count, head_count_kv, key_length, value_length, q_lora_rank,
//! output_lora_rank, output_group_count, sliding_window, layer_norm_rms_epsilon,
//! compress_rope_freq_base, compress_ratios}` (the last a u32/i32 array with one entry per layer,
//! possibly more); `attention.indexer.{head_count, key_length, top_k}`;
//! `rope.{dimension_count, freq_base}`; `rope.scaling.{factor, original_context_length,
//! yarn_beta_fast, yarn_beta_slow}`; `expert_count`, `expert_used_count`,
//! `expert_feed_forward_length`, `expert_shared_count`, `hash_layer_count`,
//! `expert_weights_scale`, `expert_weights_norm` (bool), `expert_group_count` and
//! `expert_group_used_count` (optional, must be 0); `swiglu_clamp_exp` (an f32 array, one per
//! layer); `hyper_connection.{count, sinkhorn_iterations, epsilon}`. BOS/EOS are looked up by
//! token text in `tokenizer.ggml.tokens`.
//!
//! [`ds4_config`] builds the [`Config`] from those keys where present, from the tensor shapes
//! (which ds4's `tensor_expect_layout` ties to the same numbers), and from the V4-Flash preset
//! for what neither carries; a key that disagrees with the tensors is an error naming the key.
//! [`ds4_metadata`] writes the keys, so that `dsv4 quantize` output carries them too.

use crate::config::{AttnKind, Config, ConfigError, LayerSpec, Layout, Yarn};
use crate::gguf::{GgufFile, GgufValue};
use crate::store::LoadError;

const ARCH: &str = "deepseek4";
const BOS_TEXT: &str = "<｜begin▁of▁sentence｜>";
const EOS_TEXT: &str = "<｜end▁of▁sentence｜>";

fn err(field: &str, msg: impl Into<String>) -> ConfigError {
    ConfigError::Field { field: field.to_string(), msg: msg.into() }
}

/// Collects values and remembers where each came from.
struct Infer<'a> {
    g: &'a GgufFile,
    meta: Vec<&'static str>,
    tensors: Vec<&'static str>,
    both: Vec<&'static str>,
    preset: Vec<&'static str>,
}

impl Infer<'_> {
    fn key(k: &str) -> String {
        format!("{ARCH}.{k}")
    }

    fn value(&self, k: &str) -> Option<&GgufValue> {
        self.g.metadata(&Self::key(k))
    }

    fn meta_usize(&self, k: &str) -> Result<Option<usize>, ConfigError> {
        self.value(k)
            .map(|v| {
                v.as_u64()
                    .and_then(|x| usize::try_from(x).ok())
                    .ok_or_else(|| err(&Self::key(k), format!("expected a non-negative integer, found {v:?}")))
            })
            .transpose()
    }

    fn meta_f64(&self, k: &str) -> Result<Option<f64>, ConfigError> {
        self.value(k)
            .map(|v| v.as_f64().ok_or_else(|| err(&Self::key(k), format!("expected a number, found {v:?}"))))
            .transpose()
    }

    /// The last dim `i` of tensor `name`'s row-major shape, if the tensor exists.
    fn dim(&self, name: &str, i: usize) -> Option<(usize, String)> {
        let t = self.g.info(name)?;
        t.shape.get(i).map(|&v| (v, format!("tensor `{name}` {:?}", t.shape)))
    }

    /// A size from metadata key `k` and/or a tensor shape (`tensor`: value and what it was read
    /// from), else `preset`; metadata and tensors must agree.
    fn usize(
        &mut self,
        field: &'static str,
        k: &str,
        tensor: Option<(usize, String)>,
        preset: usize,
    ) -> Result<usize, ConfigError> {
        match (self.meta_usize(k)?, tensor) {
            (Some(m), Some((t, from))) if m != t => {
                Err(err(&Self::key(k), format!("metadata says {m} but {from} gives {t} (field {field})")))
            }
            (Some(m), Some(_)) => {
                self.both.push(field);
                Ok(m)
            }
            (Some(m), None) => {
                self.meta.push(field);
                Ok(m)
            }
            (None, Some((t, _))) => {
                self.tensors.push(field);
                Ok(t)
            }
            (None, None) => {
                self.preset.push(field);
                Ok(preset)
            }
        }
    }

    /// A number only metadata carries, else `preset`.
    fn f64(&mut self, field: &'static str, k: &str, preset: f64) -> Result<f64, ConfigError> {
        Ok(match self.meta_f64(k)? {
            Some(v) => {
                self.meta.push(field);
                v
            }
            None => {
                self.preset.push(field);
                preset
            }
        })
    }

    /// A metadata array of numbers (one per layer), if present.
    fn meta_list(&self, k: &str) -> Result<Option<Vec<f64>>, ConfigError> {
        let Some(v) = self.value(k) else { return Ok(None) };
        let a = v.as_array().ok_or_else(|| err(&Self::key(k), format!("expected an array, found {v:?}")))?;
        a.iter()
            .enumerate()
            .map(|(i, x)| {
                x.as_f64().ok_or_else(|| err(&format!("{}[{i}]", Self::key(k)), format!("not a number: {x:?}")))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    /// A token id: `tokenizer.ggml.{which}_token_id`, else the position of `text` in
    /// `tokenizer.ggml.tokens` (how ds4 finds them), else `preset`.
    fn token(&mut self, field: &'static str, which: &str, text: &str, preset: u32) -> Result<u32, ConfigError> {
        let key = format!("tokenizer.ggml.{which}_token_id");
        if let Some(v) = self.g.metadata(&key) {
            self.meta.push(field);
            return v
                .as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| err(&key, format!("expected a token id, found {v:?}")));
        }
        let pos = self
            .g
            .metadata("tokenizer.ggml.tokens")
            .and_then(GgufValue::as_array)
            .and_then(|t| t.iter().position(|s| s.as_str() == Some(text)));
        if let Some(p) = pos {
            self.meta.push(field);
            return Ok(p as u32);
        }
        self.preset.push(field);
        Ok(preset)
    }
}

/// The configuration of a ds4-style GGUF (see the module doc). `Layout::Official`, since ds4's
/// tensor names map to the official ones.
pub fn ds4_config(g: &GgufFile) -> Result<Config, LoadError> {
    let path = g.path().display().to_string();
    if let Some(a) = g.metadata("general.architecture") {
        if a.as_str() != Some(ARCH) {
            return Err(LoadError::Format {
                path,
                msg: format!("general.architecture is {a:?}, not `{ARCH}`, and there is no `dsv4.config_json`"),
            });
        }
    }
    let n_layers = (0..).take_while(|l| g.contains(&format!("blk.{l}.attn_norm.weight"))).count();
    if n_layers == 0 || !g.contains("token_embd.weight") {
        return Err(LoadError::Format {
            path,
            msg: "no `dsv4.config_json` metadata and no ds4 DeepSeek V4 tensors (`token_embd.weight`, \
                  `blk.0.attn_norm.weight`) to infer the configuration from"
                .into(),
        });
    }
    let cfg = infer(g, n_layers)?;
    Ok(cfg)
}

fn infer(g: &GgufFile, n_layers: usize) -> Result<Config, ConfigError> {
    let p = Config::flash();
    let mut f = Infer { g, meta: Vec::new(), tensors: Vec::new(), both: Vec::new(), preset: Vec::new() };
    let blk = |l: usize, s: &str| format!("blk.{l}.{s}");
    let n_layers = f.usize("n_layers", "block_count", Some((n_layers, "the `blk.N.*` tensors".into())), 0)?;
    let vocab_size = f.usize("vocab_size", "vocab_size", f.dim("token_embd.weight", 0), p.vocab_size)?;
    let hidden = f.usize("hidden", "embedding_length", f.dim("token_embd.weight", 1), p.hidden)?;
    let n_heads = f.usize("n_heads", "attention.head_count", f.dim(&blk(0, "attn_sinks.weight"), 0), p.n_heads)?;
    let head_dim = f.usize("head_dim", "attention.key_length", f.dim(&blk(0, "attn_kv.weight"), 0), p.head_dim)?;
    // ds4 checks these two against its fixed shape; dsv4 has one KV head and value = key width too.
    for (k, want) in [("attention.head_count_kv", 1), ("attention.value_length", head_dim)] {
        if let Some(v) = f.meta_usize(k)?.filter(|&v| v != want) {
            return Err(err(&Infer::key(k), format!("{v} is not supported (DeepSeek V4 has {want})")));
        }
    }
    for k in ["expert_group_count", "expert_group_used_count"] {
        if let Some(v) = f.meta_usize(k)?.filter(|&v| v != 0) {
            return Err(err(&Infer::key(k), format!("{v}: grouped routing is not DeepSeek V4's (expected 0)")));
        }
    }
    let rope_dim = f.usize("rope_dim", "rope.dimension_count", None, p.rope_dim)?;
    let q_lora_rank =
        f.usize("q_lora_rank", "attention.q_lora_rank", f.dim(&blk(0, "attn_q_a.weight"), 0), p.q_lora_rank)?;
    // wo_a is [o_groups·o_lora, n_heads·head_dim/o_groups].
    let wo_a = f.g.info(&blk(0, "attn_output_a.weight")).map(|t| t.shape.clone());
    let groups = wo_a.as_ref().and_then(|s| {
        let g = (n_heads * head_dim).checked_div(s.get(1).copied().filter(|&c| c > 0)?)?;
        Some((g, format!("tensor `{}` {s:?}", blk(0, "attn_output_a.weight"))))
    });
    let o_groups = f.usize("o_groups", "attention.output_group_count", groups, p.o_groups)?;
    let o_lora = wo_a.as_ref().and_then(|s| {
        Some((s.first()? / o_groups.max(1), format!("tensor `{}` {s:?}", blk(0, "attn_output_a.weight"))))
    });
    let o_lora_rank = f.usize("o_lora_rank", "attention.output_lora_rank", o_lora, p.o_lora_rank)?;
    let window = f.usize("window", "attention.sliding_window", None, p.window)?;

    // Per-layer schedule: compressor tensors say which attention, `ape` the ratio, `tid2eid`
    // which layers are hash-routed.
    let meta_ratios = f.meta_list("attention.compress_ratios")?;
    if let Some(r) = &meta_ratios {
        if r.len() < n_layers {
            return Err(err(
                &Infer::key("attention.compress_ratios"),
                format!("has {} entries for {n_layers} layers", r.len()),
            ));
        }
    }
    let mut layers = Vec::with_capacity(n_layers);
    for l in 0..n_layers {
        let (attn, ratio) = match f.dim(&blk(l, "attn_compressor_ape.weight"), 0) {
            None => (AttnKind::Swa, 0),
            Some((r, _)) if g.contains(&blk(l, "indexer.proj.weight")) => (AttnKind::Csa, r),
            Some((r, _)) => (AttnKind::Hca, r),
        };
        if let Some(m) = meta_ratios.as_ref().map(|r| r[l]).filter(|&m| m != ratio as f64) {
            return Err(err(
                &format!("{}[{l}]", Infer::key("attention.compress_ratios")),
                format!("metadata says ratio {m} but layer {l}'s tensors are {attn:?} with ratio {ratio}"),
            ));
        }
        layers.push(LayerSpec { attn, ratio, hash_moe: g.contains(&blk(l, "ffn_gate_tid2eid.weight")) });
    }
    if meta_ratios.is_some() {
        f.both.push("layers.ratio");
    } else {
        f.tensors.push("layers.ratio");
    }
    let n_hash = layers.iter().take_while(|l| l.hash_moe).count();
    if layers[n_hash..].iter().any(|l| l.hash_moe) {
        return Err(err("layers.hash_moe", "hash-routed layers (with `ffn_gate_tid2eid`) must come first"));
    }
    f.usize("layers.hash_moe", "hash_layer_count", Some((n_hash, "the `ffn_gate_tid2eid` tensors".into())), 0)?;

    let csa = layers.iter().position(|l| l.attn == AttnKind::Csa);
    let ix = |s: &str| csa.and_then(|l| f.dim(&blk(l, s), 0));
    let (ix_heads, ix_dim) = (ix("indexer.proj.weight"), ix("indexer_compressor_norm.weight"));
    let index_n_heads = f.usize("index_n_heads", "attention.indexer.head_count", ix_heads, p.index_n_heads)?;
    let index_head_dim = f.usize("index_head_dim", "attention.indexer.key_length", ix_dim, p.index_head_dim)?;
    let index_topk = f.usize("index_topk", "attention.indexer.top_k", None, p.index_topk)?;
    let n_routed_experts =
        f.usize("n_routed_experts", "expert_count", f.dim(&blk(0, "ffn_gate_inp.weight"), 0), p.n_routed_experts)?;
    let used = (0..n_hash).next().and_then(|l| f.dim(&blk(l, "ffn_gate_tid2eid.weight"), 1));
    let n_experts_per_tok = f.usize("n_experts_per_tok", "expert_used_count", used, p.n_experts_per_tok)?;
    let n_shared_experts = f.usize("n_shared_experts", "expert_shared_count", None, p.n_shared_experts)?;
    let inter = f.dim(&blk(0, "ffn_gate_exps.weight"), 1).or_else(|| f.dim(&blk(0, "ffn_gate_shexp.weight"), 0));
    let moe_inter = f.usize("moe_inter", "expert_feed_forward_length", inter, p.moe_inter)?;
    let hc_mult = f.usize("hc_mult", "hyper_connection.count", f.dim("output_hc_base.weight", 0), p.hc_mult)?;
    let hc_sinkhorn_iters =
        f.usize("hc_sinkhorn_iters", "hyper_connection.sinkhorn_iterations", None, p.hc_sinkhorn_iters)?;

    let norm_topk_prob = match g.metadata(&Infer::key("expert_weights_norm")) {
        Some(v) => {
            f.meta.push("norm_topk_prob");
            v.as_bool()
                .ok_or_else(|| err(&Infer::key("expert_weights_norm"), format!("expected a bool, found {v:?}")))?
        }
        None => {
            f.preset.push("norm_topk_prob");
            p.norm_topk_prob
        }
    };
    let routed_scale = f.f64("routed_scale", "expert_weights_scale", p.routed_scale as f64)? as f32;
    let swiglu_limit = match f.meta_list("swiglu_clamp_exp")? {
        Some(v) => {
            let first = *v.first().ok_or_else(|| err(&Infer::key("swiglu_clamp_exp"), "empty"))?;
            if let Some(i) = v.iter().take(n_layers).position(|&x| x != first) {
                return Err(err(
                    &format!("{}[{i}]", Infer::key("swiglu_clamp_exp")),
                    format!("{} differs from layer 0's {first}: dsv4 has one clamp for all layers", v[i]),
                ));
            }
            f.meta.push("swiglu_limit");
            first as f32
        }
        None => {
            f.preset.push("swiglu_limit");
            p.swiglu_limit
        }
    };
    let hc_eps = f.f64("hc_eps", "hyper_connection.epsilon", p.hc_eps as f64)? as f32;
    let rms_eps = f.f64("rms_eps", "attention.layer_norm_rms_epsilon", p.rms_eps as f64)? as f32;
    let rope_theta = f.f64("rope_theta", "rope.freq_base", p.rope_theta)?;
    let compress_rope_theta =
        f.f64("compress_rope_theta", "attention.compress_rope_freq_base", p.compress_rope_theta)?;
    let py = p.yarn.expect("the Flash preset uses YaRN");
    // An original context of 0 is how ds4_metadata writes "no YaRN".
    let yarn = Yarn {
        factor: f.f64("yarn.factor", "rope.scaling.factor", py.factor)?,
        original_max_position: f.f64(
            "yarn.original_max_position",
            "rope.scaling.original_context_length",
            py.original_max_position,
        )?,
        beta_fast: f.f64("yarn.beta_fast", "rope.scaling.yarn_beta_fast", py.beta_fast)?,
        beta_slow: f.f64("yarn.beta_slow", "rope.scaling.yarn_beta_slow", py.beta_slow)?,
    };
    let max_position = f.usize("max_position", "context_length", None, p.max_position)?;
    let bos_token_id = f.token("bos_token_id", "bos", BOS_TEXT, p.bos_token_id)?;
    let eos = f.token("eos_token_ids", "eos", EOS_TEXT, p.eos_token_ids.first().copied().unwrap_or(1))?;
    // ds4 keeps the MTP block in a separate GGUF; this file's layers are the main model's.
    let cfg = Config {
        layout: Layout::Official,
        vocab_size,
        hidden,
        n_heads,
        head_dim,
        rope_dim,
        q_lora_rank,
        o_groups,
        o_lora_rank,
        window,
        index_n_heads,
        index_head_dim,
        index_topk,
        n_routed_experts,
        n_experts_per_tok,
        n_shared_experts,
        moe_inter,
        norm_topk_prob,
        routed_scale,
        swiglu_limit,
        hc_mult,
        hc_sinkhorn_iters,
        hc_eps,
        rms_eps,
        rope_theta,
        compress_rope_theta,
        yarn: (yarn.original_max_position > 0.0).then_some(yarn),
        max_position,
        bos_token_id,
        eos_token_ids: vec![eos],
        n_mtp_layers: 0,
        layers,
    };
    tracing::info!(
        "{}: no dsv4.config_json; configuration from ds4 metadata and tensor shapes (agreeing): {}; \
         from metadata only: {}; from tensor shapes only: {}; V4-Flash preset: {}",
        g.path().display(),
        list(&f.both),
        list(&f.meta),
        list(&f.tensors),
        list(&f.preset)
    );
    cfg.validate()?;
    Ok(cfg)
}

fn list(v: &[&str]) -> String {
    if v.is_empty() {
        "none".into()
    } else {
        v.join(", ")
    }
}

/// ds4's `deepseek4.*` metadata for `cfg` (the keys [`ds4_config`] reads), with ds4's value types:
/// u32 sizes, f32 numbers, a bool, u32/f32 arrays with one entry per layer.
pub fn ds4_metadata(cfg: &Config) -> Vec<(String, GgufValue)> {
    let u = |v: usize| GgufValue::U32(v as u32);
    let f = |v: f64| GgufValue::F32(v as f32);
    let yarn = cfg.yarn.unwrap_or(Yarn { factor: 1.0, original_max_position: 0.0, beta_fast: 32.0, beta_slow: 1.0 });
    let n_hash = cfg.layers.iter().take_while(|l| l.hash_moe).count();
    let kv = [
        ("block_count", u(cfg.n_layers())),
        ("context_length", GgufValue::U64(cfg.max_position as u64)),
        ("embedding_length", u(cfg.hidden)),
        ("vocab_size", u(cfg.vocab_size)),
        ("attention.head_count", u(cfg.n_heads)),
        ("attention.head_count_kv", u(1)),
        ("attention.key_length", u(cfg.head_dim)),
        ("attention.value_length", u(cfg.head_dim)),
        ("attention.q_lora_rank", u(cfg.q_lora_rank)),
        ("attention.output_lora_rank", u(cfg.o_lora_rank)),
        ("attention.output_group_count", u(cfg.o_groups)),
        ("attention.sliding_window", u(cfg.window)),
        ("attention.layer_norm_rms_epsilon", f(cfg.rms_eps as f64)),
        ("attention.compress_rope_freq_base", f(cfg.compress_rope_theta)),
        ("attention.compress_ratios", GgufValue::Array(cfg.layers.iter().map(|l| u(l.ratio)).collect())),
        ("attention.indexer.head_count", u(cfg.index_n_heads)),
        ("attention.indexer.key_length", u(cfg.index_head_dim)),
        ("attention.indexer.top_k", u(cfg.index_topk)),
        ("rope.dimension_count", u(cfg.rope_dim)),
        ("rope.freq_base", f(cfg.rope_theta)),
        ("rope.scaling.factor", f(yarn.factor)),
        ("rope.scaling.original_context_length", GgufValue::U64(yarn.original_max_position as u64)),
        ("rope.scaling.yarn_beta_fast", f(yarn.beta_fast)),
        ("rope.scaling.yarn_beta_slow", f(yarn.beta_slow)),
        ("expert_count", u(cfg.n_routed_experts)),
        ("expert_used_count", u(cfg.n_experts_per_tok)),
        ("expert_feed_forward_length", u(cfg.moe_inter)),
        ("expert_shared_count", u(cfg.n_shared_experts)),
        ("expert_group_count", u(0)),
        ("expert_group_used_count", u(0)),
        ("hash_layer_count", u(n_hash)),
        ("expert_weights_scale", f(cfg.routed_scale as f64)),
        ("expert_weights_norm", GgufValue::Bool(cfg.norm_topk_prob)),
        ("swiglu_clamp_exp", GgufValue::Array(vec![f(cfg.swiglu_limit as f64); cfg.n_layers()])),
        ("hyper_connection.count", u(cfg.hc_mult)),
        ("hyper_connection.sinkhorn_iterations", u(cfg.hc_sinkhorn_iters)),
        ("hyper_connection.epsilon", f(cfg.hc_eps as f64)),
    ];
    kv.into_iter().map(|(k, v)| (format!("{ARCH}.{k}"), v)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{official_expert_to_gguf, official_to_gguf, GgmlType};
    use crate::gguf_write::GgufWriter;
    use crate::store::{f32_bytes, write_safetensors, TensorStore};
    use crate::synth::{random_checkpoint, tiny_config, SynthDType};
    use crate::weights::{load_weights_from, Source};
    use std::collections::BTreeMap;
    use std::path::Path;

    type Tensor = (String, GgmlType, Vec<usize>, Vec<u8>);
    /// Expert index → (shape, values), per stacked tensor.
    type Stacks = BTreeMap<String, BTreeMap<usize, (Vec<usize>, Vec<f32>)>>;

    /// A random model for `cfg` as F32 tensors under ds4's names (experts stacked, I32 hash
    /// tables), read through the loader like `dsv4 quantize` does.
    fn ds4_tensors(cfg: &Config, dir: &Path) -> Vec<Tensor> {
        let st = dir.join("st");
        std::fs::create_dir_all(&st).unwrap();
        std::fs::write(st.join("config.json"), serde_json::to_string(&cfg.to_hf_json()).unwrap()).unwrap();
        write_safetensors(&st.join("model.safetensors"), &random_checkpoint(cfg, 3, SynthDType::F32)).unwrap();
        let store = TensorStore::open(&st).unwrap();
        let mut out = Vec::new();
        let mut stacks = Stacks::new();
        let (w, _) = load_weights_from(Source::Safetensors(&store), cfg, false, |t| {
            if let Some((g, e)) = official_expert_to_gguf(&t.name) {
                stacks.entry(g).or_default().insert(e, (t.shape, t.data));
            } else {
                let g = official_to_gguf(&t.name).unwrap();
                out.push((g, GgmlType::F32, t.shape, f32_bytes(&t.data)));
            }
            Ok(())
        })
        .unwrap();
        for (g, experts) in stacks {
            let shape = experts[&0].0.clone();
            let data: Vec<f32> = experts.into_values().flat_map(|(_, d)| d).collect();
            out.push((g, GgmlType::F32, vec![cfg.n_routed_experts, shape[0], shape[1]], f32_bytes(&data)));
        }
        for (l, layer) in w.layers.iter().enumerate() {
            if let Some(ids) = &layer.ffn.tid2eid {
                let b = ids.iter().flat_map(|&x| (x as i32).to_le_bytes()).collect();
                out.push((
                    format!("blk.{l}.ffn_gate_tid2eid.weight"),
                    GgmlType::I32,
                    vec![cfg.vocab_size, cfg.n_experts_per_tok],
                    b,
                ));
            }
        }
        out
    }

    fn write(path: &Path, tensors: &[Tensor], meta: &[(String, GgufValue)]) -> GgufFile {
        let mut w = GgufWriter::new();
        w.add_meta("general.architecture", GgufValue::String("deepseek4".into()));
        for (k, v) in meta {
            w.add_meta(k, v.clone());
        }
        for (n, t, s, d) in tensors {
            w.add_tensor(n, *t, s, d.clone()).unwrap();
        }
        w.write(path).unwrap();
        GgufFile::open(path).unwrap()
    }

    #[test]
    fn ds4_metadata_and_tensors_give_the_config() {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = tiny_config(64);
        let tensors = ds4_tensors(&cfg, tmp.path());
        let want = Config { layout: Layout::Official, ..cfg.clone() };
        let g = write(&tmp.path().join("a.gguf"), &tensors, &ds4_metadata(&cfg));
        assert_eq!(g.config().unwrap(), want);
        // Keys the tensors also carry may be left out.
        let fewer: Vec<_> = ds4_metadata(&cfg)
            .into_iter()
            .filter(|(k, _)| !k.ends_with(".embedding_length") && !k.ends_with(".compress_ratios"))
            .collect();
        assert_eq!(write(&tmp.path().join("b.gguf"), &tensors, &fewer).config().unwrap(), want);
    }

    #[test]
    fn without_metadata_shapes_and_the_flash_preset_decide() {
        let tmp = tempfile::tempdir().unwrap();
        // A tiny model whose non-shape fields are V4-Flash's, so the preset reproduces it.
        let flash = Config::flash();
        let mut cfg = tiny_config(64);
        (cfg.head_dim, cfg.rope_dim, cfg.index_head_dim) = (64, 64, 64);
        (cfg.window, cfg.index_topk, cfg.swiglu_limit, cfg.yarn) =
            (flash.window, flash.index_topk, flash.swiglu_limit, flash.yarn);
        let tensors = ds4_tensors(&cfg, tmp.path());
        let g = write(&tmp.path().join("a.gguf"), &tensors, &[]);
        assert_eq!(g.config().unwrap(), Config { layout: Layout::Official, ..cfg });
    }

    #[test]
    fn metadata_that_contradicts_the_tensors_names_the_key() {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = tiny_config(64);
        let tensors = ds4_tensors(&cfg, tmp.path());
        let with = |k: &str, v: GgufValue| -> String {
            let mut m = ds4_metadata(&cfg);
            m.iter_mut().find(|(key, _)| key == k).unwrap().1 = v;
            let g = write(&tmp.path().join("bad.gguf"), &tensors, &m);
            g.config().unwrap_err().to_string()
        };
        let e = with("deepseek4.embedding_length", GgufValue::U32(128));
        assert!(e.contains("deepseek4.embedding_length") && e.contains("128") && e.contains("token_embd"), "{e}");
        let mut r: Vec<GgufValue> = cfg.layers.iter().map(|l| GgufValue::U32(l.ratio as u32)).collect();
        r[2] = GgufValue::U32(4);
        let e = with("deepseek4.attention.compress_ratios", GgufValue::Array(r));
        assert!(e.contains("compress_ratios[2]"), "{e}");
        let e = with("deepseek4.hash_layer_count", GgufValue::U32(1));
        assert!(e.contains("deepseek4.hash_layer_count"), "{e}");
        let e = with("deepseek4.attention.head_count", GgufValue::String("x".into()));
        assert!(e.contains("deepseek4.attention.head_count"), "{e}");
        // Not a ds4 model at all.
        let g = write(&tmp.path().join("none.gguf"), &tensors[..1], &[]);
        assert!(g.config().unwrap_err().to_string().contains("dsv4.config_json"));
    }
}
