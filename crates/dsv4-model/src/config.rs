//! DeepSeek V4 configuration, read from either `config.json` layout (HF transformers or DeepSeek's
//! official `inference/config.json`) into one normalised [`Config`] that the rest of the engine uses.
//!
//! Every value is checked: an unknown layer type, an inconsistent dimension or a value of the
//! wrong type is rejected with a [`ConfigError`] that names the field.

use serde_json::{Map, Value};
use std::path::Path;

/// A config problem, always naming the offending field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config field `{field}`: {msg}")]
    Field { field: String, msg: String },
    #[error("reading config {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("config {path} is not valid JSON: {source}")]
    Json {
        path: String,
        #[source]
        source: serde_json::Error,
    },
}

fn field_err(field: impl Into<String>, msg: impl Into<String>) -> ConfigError {
    ConfigError::Field { field: field.into(), msg: msg.into() }
}

/// Which attention a layer uses (spec §0): plain sliding window, compressed sparse (with the
/// lightning indexer) or heavily compressed (dense over all compressed entries).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKind {
    Swa,
    Csa,
    Hca,
}

/// The per-layer schedule: attention kind, its compression ratio (0 for SWA) and whether the
/// MoE router is hash-routed by token id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerSpec {
    pub attn: AttnKind,
    pub ratio: usize,
    pub hash_moe: bool,
}

/// YaRN frequency correction parameters (applied to CSA/HCA layers only, spec §3.2).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
}

/// Which `config.json` layout the checkpoint used; also decides the tensor naming.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    Hf,
    Official,
}

/// The normalised model configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub layout: Layout,
    pub vocab_size: usize,
    pub hidden: usize,
    pub n_heads: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    pub q_lora_rank: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    pub window: usize,
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    pub n_routed_experts: usize,
    pub n_experts_per_tok: usize,
    pub n_shared_experts: usize,
    pub moe_inter: usize,
    pub norm_topk_prob: bool,
    pub routed_scale: f32,
    pub swiglu_limit: f32,
    pub hc_mult: usize,
    pub hc_sinkhorn_iters: usize,
    pub hc_eps: f32,
    pub rms_eps: f32,
    pub rope_theta: f64,
    pub compress_rope_theta: f64,
    pub yarn: Option<Yarn>,
    pub max_position: usize,
    pub bos_token_id: u32,
    pub eos_token_ids: Vec<u32>,
    pub n_mtp_layers: usize,
    pub layers: Vec<LayerSpec>,
}

struct Fields<'a> {
    map: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }
    fn usize_or(&self, key: &str, default: Option<usize>) -> Result<usize, ConfigError> {
        match self.get(key) {
            Some(v) => v
                .as_u64()
                .map(|x| x as usize)
                .or_else(|| v.as_f64().filter(|f| f.fract() == 0.0 && *f >= 0.0).map(|f| f as usize))
                .ok_or_else(|| field_err(key, format!("expected a non-negative integer, found {v}"))),
            None => default.ok_or_else(|| field_err(key, "missing")),
        }
    }
    fn f64_or(&self, key: &str, default: Option<f64>) -> Result<f64, ConfigError> {
        match self.get(key) {
            Some(v) => v.as_f64().ok_or_else(|| field_err(key, format!("expected a number, found {v}"))),
            None => default.ok_or_else(|| field_err(key, "missing")),
        }
    }
    fn bool_or(&self, key: &str, default: bool) -> Result<bool, ConfigError> {
        match self.get(key) {
            Some(v) => v.as_bool().ok_or_else(|| field_err(key, format!("expected true or false, found {v}"))),
            None => Ok(default),
        }
    }
    fn str_or(&self, key: &str, default: &'a str) -> Result<&'a str, ConfigError> {
        match self.get(key) {
            Some(v) => v.as_str().ok_or_else(|| field_err(key, format!("expected a string, found {v}"))),
            None => Ok(default),
        }
    }
    fn str_list(&self, key: &str) -> Result<Option<Vec<String>>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| field_err(format!("{key}[{i}]"), format!("expected a string, found {v}")))
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(v) => Err(field_err(key, format!("expected a list, found {v}"))),
        }
    }
    fn usize_list(&self, key: &str) -> Result<Option<Vec<usize>>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_u64()
                        .map(|x| x as usize)
                        .ok_or_else(|| field_err(format!("{key}[{i}]"), format!("expected an integer, found {v}")))
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(v) => Err(field_err(key, format!("expected a list, found {v}"))),
        }
    }
    fn token_ids(&self, key: &str, default: u32) -> Result<Vec<u32>, ConfigError> {
        match self.get(key) {
            None => Ok(vec![default]),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|x| u32::try_from(x).ok())
                        .ok_or_else(|| field_err(key, format!("bad token id {v}")))
                })
                .collect(),
            Some(v) => v
                .as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .map(|x| vec![x])
                .ok_or_else(|| field_err(key, format!("bad token id {v}"))),
        }
    }
}

fn yarn_from(obj: &Map<String, Value>, field: &str) -> Result<Option<Yarn>, ConfigError> {
    let f = Fields { map: obj };
    let ty = f.get("rope_type").or_else(|| f.get("type")).and_then(|v| v.as_str()).unwrap_or("default");
    match ty {
        "default" => Ok(None),
        "yarn" => Ok(Some(Yarn {
            factor: f.f64_or("factor", None).map_err(|e| prefix(e, field))?,
            original_max_position: f.f64_or("original_max_position_embeddings", None).map_err(|e| prefix(e, field))?,
            beta_fast: f.f64_or("beta_fast", Some(32.0)).map_err(|e| prefix(e, field))?,
            beta_slow: f.f64_or("beta_slow", Some(1.0)).map_err(|e| prefix(e, field))?,
        })),
        other => Err(field_err(
            format!("{field}.rope_type"),
            format!("unsupported RoPE type `{other}` (DeepSeek V4 uses yarn)"),
        )),
    }
}

fn prefix(e: ConfigError, p: &str) -> ConfigError {
    match e {
        ConfigError::Field { field, msg } => ConfigError::Field { field: format!("{p}.{field}"), msg },
        other => other,
    }
}

impl Config {
    /// Reads `dir/config.json` (either layout).
    pub fn from_dir(dir: &Path) -> Result<Self, ConfigError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|source| ConfigError::Io { path: path.display().to_string(), source })?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|source| ConfigError::Json { path: path.display().to_string(), source })?;
        Self::from_json(&v)
    }

    /// Parses a config JSON value; the layout is detected from its keys (`dim`/`n_layers` are
    /// official, `hidden_size`/`num_hidden_layers` are HF).
    pub fn from_json(v: &Value) -> Result<Self, ConfigError> {
        let map = v.as_object().ok_or_else(|| field_err("<root>", "expected a JSON object"))?;
        let cfg = if map.contains_key("dim") || map.contains_key("n_layers") {
            Self::from_official(map)?
        } else {
            Self::from_hf(map)?
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn from_hf(map: &Map<String, Value>) -> Result<Self, ConfigError> {
        let f = Fields { map };
        if let Some(mt) = f.get("model_type").and_then(|v| v.as_str()) {
            if mt != "deepseek_v4" {
                return Err(field_err("model_type", format!("expected `deepseek_v4`, found `{mt}`")));
            }
        }
        let n_layers = f.usize_or("num_hidden_layers", None)?;
        let head_dim = f.usize_or("head_dim", Some(512))?;
        let rope_dim = match (f.get("qk_rope_head_dim"), f.get("partial_rotary_factor")) {
            (Some(_), _) => f.usize_or("qk_rope_head_dim", None)?,
            (None, Some(_)) => {
                let p = f.f64_or("partial_rotary_factor", None)?;
                (head_dim as f64 * p).round() as usize
            }
            (None, None) => head_dim / 8,
        };
        // Compression ratio per layer type (HF lets tests change them per type).
        let mut csa_ratio = 4usize;
        let mut hca_ratio = 128usize;
        if let Some(Value::Object(rates)) = f.get("compress_rates") {
            for (k, v) in rates {
                let r = v.as_u64().ok_or_else(|| {
                    field_err(format!("compress_rates.{k}"), format!("expected an integer, found {v}"))
                })? as usize;
                match k.as_str() {
                    "compressed_sparse_attention" => csa_ratio = r,
                    "heavily_compressed_attention" => hca_ratio = r,
                    other => return Err(field_err(format!("compress_rates.{other}"), "unknown layer type")),
                }
            }
        }
        let types: Vec<AttnKind> = if let Some(lt) = f.str_list("layer_types")? {
            lt.iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    "sliding_attention" => Ok(AttnKind::Swa),
                    "compressed_sparse_attention" => Ok(AttnKind::Csa),
                    "heavily_compressed_attention" => Ok(AttnKind::Hca),
                    other => Err(field_err(
                        format!("layer_types[{i}]"),
                        format!("unknown layer type `{other}` (expected sliding_attention, compressed_sparse_attention or heavily_compressed_attention)"),
                    )),
                })
                .collect::<Result<_, _>>()?
        } else if let Some(r) = f.usize_list("compress_ratios")? {
            ratios_to_kinds(&r, "compress_ratios")?.into_iter().map(|(k, _)| k).collect()
        } else {
            return Err(field_err(
                "layer_types",
                "missing (and no compress_ratios): the layer schedule must come from the checkpoint",
            ));
        };
        if types.len() < n_layers {
            return Err(field_err(
                "layer_types",
                format!("has {} entries, num_hidden_layers is {n_layers}", types.len()),
            ));
        }
        let n_hash = f.usize_or("num_hash_layers", Some(3))?;
        let mlp: Vec<bool> = if let Some(m) = f.str_list("mlp_layer_types")? {
            if m.len() < n_layers {
                return Err(field_err(
                    "mlp_layer_types",
                    format!("has {} entries, num_hidden_layers is {n_layers}", m.len()),
                ));
            }
            m.iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    "hash_moe" => Ok(true),
                    "moe" => Ok(false),
                    other => Err(field_err(
                        format!("mlp_layer_types[{i}]"),
                        format!("unknown MLP type `{other}` (expected hash_moe or moe)"),
                    )),
                })
                .collect::<Result<_, _>>()?
        } else {
            (0..n_layers).map(|i| i < n_hash).collect()
        };
        let layers = (0..n_layers)
            .map(|i| {
                let attn = types[i];
                let ratio = match attn {
                    AttnKind::Swa => 0,
                    AttnKind::Csa => csa_ratio,
                    AttnKind::Hca => hca_ratio,
                };
                LayerSpec { attn, ratio, hash_moe: mlp[i] }
            })
            .collect();

        // RoPE: HF nests {"main": {...}, "compress": {...}}; older configs carry `rope_scaling`.
        let rope_theta = f.f64_or("rope_theta", Some(10000.0))?;
        let mut compress_rope_theta = f.f64_or("compress_rope_theta", Some(160000.0))?;
        let mut yarn = None;
        match f.get("rope_parameters") {
            Some(Value::Object(rp)) => {
                if let Some(Value::Object(c)) = rp.get("compress") {
                    yarn = yarn_from(c, "rope_parameters.compress")?;
                    if let Some(t) = c.get("rope_theta").and_then(|v| v.as_f64()) {
                        compress_rope_theta = t;
                    }
                } else {
                    yarn = yarn_from(rp, "rope_parameters")?;
                }
            }
            Some(v) => return Err(field_err("rope_parameters", format!("expected an object, found {v}"))),
            None => {}
        }
        if yarn.is_none() {
            if let Some(Value::Object(rs)) = f.get("rope_scaling") {
                yarn = yarn_from(rs, "rope_scaling")?;
            }
        }
        let scoring = f.str_or("scoring_func", "sqrtsoftplus")?;
        if scoring != "sqrtsoftplus" {
            return Err(field_err(
                "scoring_func",
                format!("`{scoring}` is not supported (DeepSeek V4 uses sqrtsoftplus)"),
            ));
        }
        Ok(Config {
            layout: Layout::Hf,
            vocab_size: f.usize_or("vocab_size", None)?,
            hidden: f.usize_or("hidden_size", None)?,
            n_heads: f.usize_or("num_attention_heads", None)?,
            head_dim,
            rope_dim,
            q_lora_rank: f.usize_or("q_lora_rank", None)?,
            o_groups: f.usize_or("o_groups", None)?,
            o_lora_rank: f.usize_or("o_lora_rank", None)?,
            window: f.usize_or("sliding_window", Some(128))?,
            index_n_heads: f.usize_or("index_n_heads", Some(64))?,
            index_head_dim: f.usize_or("index_head_dim", Some(128))?,
            index_topk: f.usize_or("index_topk", Some(512))?,
            n_routed_experts: f.usize_or("n_routed_experts", None)?,
            n_experts_per_tok: f.usize_or("num_experts_per_tok", None)?,
            n_shared_experts: f.usize_or("n_shared_experts", Some(1))?,
            moe_inter: f.usize_or("moe_intermediate_size", None)?,
            norm_topk_prob: f.bool_or("norm_topk_prob", true)?,
            routed_scale: f.f64_or("routed_scaling_factor", Some(1.5))? as f32,
            swiglu_limit: f.f64_or("swiglu_limit", Some(10.0))? as f32,
            hc_mult: f.usize_or("hc_mult", Some(4))?,
            hc_sinkhorn_iters: f.usize_or("hc_sinkhorn_iters", Some(20))?,
            hc_eps: f.f64_or("hc_eps", Some(1e-6))? as f32,
            rms_eps: f.f64_or("rms_norm_eps", Some(1e-6))? as f32,
            rope_theta,
            compress_rope_theta,
            yarn,
            max_position: f.usize_or("max_position_embeddings", Some(1 << 20))?,
            bos_token_id: f.usize_or("bos_token_id", Some(0))? as u32,
            eos_token_ids: f.token_ids("eos_token_id", 1)?,
            n_mtp_layers: f.usize_or("num_nextn_predict_layers", Some(0))?,
            layers,
        })
    }

    fn from_official(map: &Map<String, Value>) -> Result<Self, ConfigError> {
        let f = Fields { map };
        let n_layers = f.usize_or("n_layers", None)?;
        let n_mtp = f.usize_or("n_mtp_layers", Some(0))?;
        let ratios = f.usize_list("compress_ratios")?.ok_or_else(|| field_err("compress_ratios", "missing"))?;
        if ratios.len() != n_layers && ratios.len() != n_layers + n_mtp {
            return Err(field_err(
                "compress_ratios",
                format!(
                    "has {} entries, expected n_layers ({n_layers}) or n_layers + n_mtp_layers ({})",
                    ratios.len(),
                    n_layers + n_mtp
                ),
            ));
        }
        let kinds = ratios_to_kinds(&ratios[..n_layers], "compress_ratios")?;
        let n_hash = f.usize_or("n_hash_layers", Some(3))?;
        let layers = kinds
            .into_iter()
            .enumerate()
            .map(|(i, (attn, ratio))| LayerSpec { attn, ratio, hash_moe: i < n_hash })
            .collect();
        let score = f.str_or("score_func", "sqrtsoftplus")?;
        if score != "sqrtsoftplus" {
            return Err(field_err("score_func", format!("`{score}` is not supported (DeepSeek V4 uses sqrtsoftplus)")));
        }
        // YaRN: either flat keys (rope_factor, original_seq_len, beta_*) or a rope_scaling object.
        let yarn = if let Some(Value::Object(rs)) = f.get("rope_scaling") {
            yarn_from(rs, "rope_scaling")?
        } else if f.get("rope_factor").is_some() {
            let orig = f.f64_or("original_seq_len", None)?;
            (orig > 0.0)
                .then(|| -> Result<Yarn, ConfigError> {
                    Ok(Yarn {
                        factor: f.f64_or("rope_factor", None)?,
                        original_max_position: orig,
                        beta_fast: f.f64_or("beta_fast", Some(32.0))?,
                        beta_slow: f.f64_or("beta_slow", Some(1.0))?,
                    })
                })
                .transpose()?
        } else {
            None
        };
        let head_dim = f.usize_or("head_dim", Some(512))?;
        Ok(Config {
            layout: Layout::Official,
            vocab_size: f.usize_or("vocab_size", None)?,
            hidden: f.usize_or("dim", None)?,
            n_heads: f.usize_or("n_heads", None)?,
            head_dim,
            rope_dim: f.usize_or("rope_head_dim", Some(64))?,
            q_lora_rank: f.usize_or("q_lora_rank", None)?,
            o_groups: f.usize_or("o_groups", None)?,
            o_lora_rank: f.usize_or("o_lora_rank", None)?,
            window: f.usize_or("window_size", Some(128))?,
            index_n_heads: f.usize_or("index_n_heads", Some(64))?,
            index_head_dim: f.usize_or("index_head_dim", Some(128))?,
            index_topk: f.usize_or("index_topk", Some(512))?,
            n_routed_experts: f.usize_or("n_routed_experts", None)?,
            n_experts_per_tok: f.usize_or("n_activated_experts", None)?,
            n_shared_experts: f.usize_or("n_shared_experts", Some(1))?,
            moe_inter: f.usize_or("moe_inter_dim", None)?,
            norm_topk_prob: true,
            routed_scale: f.f64_or("route_scale", Some(1.0))? as f32,
            swiglu_limit: f.f64_or("swiglu_limit", Some(10.0))? as f32,
            hc_mult: f.usize_or("hc_mult", Some(4))?,
            hc_sinkhorn_iters: f.usize_or("hc_sinkhorn_iters", Some(20))?,
            hc_eps: f.f64_or("hc_eps", Some(1e-6))? as f32,
            rms_eps: f.f64_or("norm_eps", Some(1e-6))? as f32,
            rope_theta: f.f64_or("rope_theta", Some(10000.0))?,
            compress_rope_theta: f.f64_or("compress_rope_theta", Some(160000.0))?,
            yarn,
            max_position: f.usize_or("max_position_embeddings", Some(1 << 20))?,
            bos_token_id: f.usize_or("bos_token_id", Some(0))? as u32,
            eos_token_ids: f.token_ids("eos_token_id", 1)?,
            n_mtp_layers: n_mtp,
            layers,
        })
    }

    /// Dimension consistency rules (spec §12.2). Called by every constructor.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let pos = |field: &str, v: usize| if v == 0 { Err(field_err(field, "must be > 0")) } else { Ok(()) };
        pos("vocab_size", self.vocab_size)?;
        // A step's token is drawn where its logits are; the device draw's sums hold 2^20 tokens
        // (dsv4_backend::draw), V4's vocabulary 129,280.
        if self.vocab_size > 1 << 20 {
            return Err(field_err("vocab_size", "must be at most 1048576"));
        }
        pos("hidden_size", self.hidden)?;
        pos("num_attention_heads", self.n_heads)?;
        pos("head_dim", self.head_dim)?;
        pos("q_lora_rank", self.q_lora_rank)?;
        pos("o_groups", self.o_groups)?;
        pos("o_lora_rank", self.o_lora_rank)?;
        pos("sliding_window", self.window)?;
        pos("n_routed_experts", self.n_routed_experts)?;
        pos("num_experts_per_tok", self.n_experts_per_tok)?;
        pos("moe_intermediate_size", self.moe_inter)?;
        pos("hc_mult", self.hc_mult)?;
        pos("hc_sinkhorn_iters", self.hc_sinkhorn_iters)?;
        if self.layers.is_empty() {
            return Err(field_err("num_hidden_layers", "must be > 0"));
        }
        if self.rope_dim == 0 || !self.rope_dim.is_multiple_of(2) || self.rope_dim > self.head_dim {
            return Err(field_err(
                "qk_rope_head_dim",
                format!("{} must be even, > 0 and <= head_dim {}", self.rope_dim, self.head_dim),
            ));
        }
        if !(self.n_heads * self.head_dim).is_multiple_of(self.o_groups) || !self.n_heads.is_multiple_of(self.o_groups)
        {
            return Err(field_err(
                "o_groups",
                format!("{} must divide num_attention_heads {}", self.o_groups, self.n_heads),
            ));
        }
        if self.n_experts_per_tok > self.n_routed_experts {
            return Err(field_err(
                "num_experts_per_tok",
                format!("{} > n_routed_experts {}", self.n_experts_per_tok, self.n_routed_experts),
            ));
        }
        if self.n_shared_experts != 1 {
            return Err(field_err(
                "n_shared_experts",
                format!("{} is not supported (DeepSeek V4 has exactly 1)", self.n_shared_experts),
            ));
        }
        if self.layers.iter().any(|l| l.attn == AttnKind::Csa) {
            pos("index_n_heads", self.index_n_heads)?;
            pos("index_topk", self.index_topk)?;
            if self.rope_dim > self.index_head_dim {
                return Err(field_err(
                    "index_head_dim",
                    format!("{} must be >= qk_rope_head_dim {}", self.index_head_dim, self.rope_dim),
                ));
            }
        }
        for (i, l) in self.layers.iter().enumerate() {
            if l.attn != AttnKind::Swa && l.ratio < 2 {
                return Err(field_err(format!("compress ratio of layer {i}"), format!("{} must be >= 2", l.ratio)));
            }
        }
        if self.rms_eps.is_nan() || self.rms_eps <= 0.0 {
            return Err(field_err("rms_norm_eps", "must be > 0"));
        }
        // A model that can hold no position, or would stop on a token it can never emit, loads
        // but cannot serve: refuse it here with the field named.
        pos("max_position_embeddings", self.max_position)?;
        if self.eos_token_ids.is_empty() {
            return Err(field_err("eos_token_id", "must name at least one token"));
        }
        if let Some(&e) = self.eos_token_ids.iter().find(|&&e| e as usize >= self.vocab_size) {
            return Err(field_err("eos_token_id", format!("{e} is outside the vocabulary (size {})", self.vocab_size)));
        }
        Ok(())
    }

    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Width of the flattened mHC residual state (`hc_mult · hidden`).
    pub fn hc_width(&self) -> usize {
        self.hc_mult * self.hidden
    }

    /// Width of the mHC mixing vector, `(2 + n)·n`.
    pub fn hc_mix(&self) -> usize {
        (2 + self.hc_mult) * self.hc_mult
    }

    /// Per-pair RoPE frequencies for a layer: plain `rope_theta` for SWA, `compress_rope_theta`
    /// with YaRN for CSA/HCA (spec §3.2). Computed in f64.
    pub fn rope_freqs(&self, attn: AttnKind) -> Vec<f64> {
        let r = self.rope_dim as f64;
        let base = if attn == AttnKind::Swa { self.rope_theta } else { self.compress_rope_theta };
        let mut f: Vec<f64> = (0..self.rope_dim / 2).map(|i| base.powf(-(2.0 * i as f64) / r)).collect();
        if attn != AttnKind::Swa {
            if let Some(y) = self.yarn {
                let corr = |nrot: f64| {
                    r * (y.original_max_position / (nrot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
                };
                let lo = corr(y.beta_fast).floor().max(0.0);
                let mut hi = corr(y.beta_slow).ceil().min(r - 1.0);
                if lo == hi {
                    hi += 0.001;
                }
                for (i, fi) in f.iter_mut().enumerate() {
                    let ramp = ((i as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
                    *fi = *fi * (1.0 - ramp) + (*fi / y.factor) * ramp;
                }
            }
        }
        f
    }

    /// The V4-Flash dimensions (spec §1.1), HF layout.
    pub fn flash() -> Self {
        let mut layers = vec![
            LayerSpec { attn: AttnKind::Swa, ratio: 0, hash_moe: true },
            LayerSpec { attn: AttnKind::Swa, ratio: 0, hash_moe: true },
        ];
        for i in 2..43 {
            let csa = i % 2 == 0;
            layers.push(LayerSpec {
                attn: if csa { AttnKind::Csa } else { AttnKind::Hca },
                ratio: if csa { 4 } else { 128 },
                hash_moe: i < 3,
            });
        }
        Config {
            layout: Layout::Hf,
            vocab_size: 129280,
            hidden: 4096,
            n_heads: 64,
            head_dim: 512,
            rope_dim: 64,
            q_lora_rank: 1024,
            o_groups: 8,
            o_lora_rank: 1024,
            window: 128,
            index_n_heads: 64,
            index_head_dim: 128,
            index_topk: 512,
            n_routed_experts: 256,
            n_experts_per_tok: 6,
            n_shared_experts: 1,
            moe_inter: 2048,
            norm_topk_prob: true,
            routed_scale: 1.5,
            swiglu_limit: 10.0,
            hc_mult: 4,
            hc_sinkhorn_iters: 20,
            hc_eps: 1e-6,
            rms_eps: 1e-6,
            rope_theta: 10000.0,
            compress_rope_theta: 160000.0,
            yarn: Some(Yarn { factor: 16.0, original_max_position: 65536.0, beta_fast: 32.0, beta_slow: 1.0 }),
            max_position: 1 << 20,
            bos_token_id: 0,
            eos_token_ids: vec![1],
            n_mtp_layers: 1,
            layers,
        }
    }

    /// The V4-Pro dimensions (spec §1.1): HCA first, then CSA/HCA interleaved.
    pub fn pro() -> Self {
        let mut c = Self::flash();
        c.hidden = 7168;
        c.n_heads = 128;
        c.q_lora_rank = 1536;
        c.o_groups = 16;
        c.index_topk = 1024;
        c.n_routed_experts = 384;
        c.moe_inter = 3072;
        c.routed_scale = 2.5;
        c.layers = (0..61)
            .map(|i| {
                let csa = i >= 2 && i % 2 == 0;
                LayerSpec {
                    attn: if csa { AttnKind::Csa } else { AttnKind::Hca },
                    ratio: if csa { 4 } else { 128 },
                    hash_moe: i < 3,
                }
            })
            .collect();
        c
    }

    /// Serialises to the HF `config.json` layout (used by `init-tiny` and tests).
    pub fn to_hf_json(&self) -> Value {
        let lt: Vec<&str> = self
            .layers
            .iter()
            .map(|l| match l.attn {
                AttnKind::Swa => "sliding_attention",
                AttnKind::Csa => "compressed_sparse_attention",
                AttnKind::Hca => "heavily_compressed_attention",
            })
            .collect();
        let mlp: Vec<&str> = self.layers.iter().map(|l| if l.hash_moe { "hash_moe" } else { "moe" }).collect();
        let ratio_of = |k: AttnKind, d: usize| self.layers.iter().find(|l| l.attn == k).map_or(d, |l| l.ratio);
        let compress = match self.yarn {
            Some(y) => serde_json::json!({
                "rope_type": "yarn", "rope_theta": self.compress_rope_theta, "factor": y.factor,
                "original_max_position_embeddings": y.original_max_position,
                "beta_fast": y.beta_fast, "beta_slow": y.beta_slow, "attention_factor": 1.0,
                "partial_rotary_factor": self.rope_dim as f64 / self.head_dim as f64,
            }),
            None => serde_json::json!({"rope_type": "default", "rope_theta": self.compress_rope_theta,
                "partial_rotary_factor": self.rope_dim as f64 / self.head_dim as f64}),
        };
        serde_json::json!({
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers.len(),
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "partial_rotary_factor": self.rope_dim as f64 / self.head_dim as f64,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.window,
            "layer_types": lt,
            "mlp_layer_types": mlp,
            "compress_rates": {
                "compressed_sparse_attention": ratio_of(AttnKind::Csa, 4),
                "heavily_compressed_attention": ratio_of(AttnKind::Hca, 128),
            },
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.n_experts_per_tok,
            "n_shared_experts": self.n_shared_experts,
            "moe_intermediate_size": self.moe_inter,
            "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scale,
            "swiglu_limit": self.swiglu_limit,
            "scoring_func": "sqrtsoftplus",
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "rope_parameters": {
                "main": {"rope_type": "default", "rope_theta": self.rope_theta,
                         "partial_rotary_factor": self.rope_dim as f64 / self.head_dim as f64},
                "compress": compress,
            },
            "max_position_embeddings": self.max_position,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids.first().copied().unwrap_or(1),
            "num_nextn_predict_layers": self.n_mtp_layers,
            "tie_word_embeddings": false,
            "torch_dtype": "float32",
        })
    }
}

/// Official `compress_ratios` values: 0 → SWA, 4 → CSA (overlap + indexer, as the official code
/// keys it), any larger ratio → HCA. 1–3 are V4.1 values this engine does not support.
fn ratios_to_kinds(r: &[usize], field: &str) -> Result<Vec<(AttnKind, usize)>, ConfigError> {
    r.iter()
        .enumerate()
        .map(|(i, &x)| match x {
            0 => Ok((AttnKind::Swa, 0)),
            4 => Ok((AttnKind::Csa, 4)),
            x if x > 4 => Ok((AttnKind::Hca, x)),
            x => Err(field_err(
                format!("{field}[{i}]"),
                format!("ratio {x} is not a DeepSeek V4 layer (expected 0, 4 or 128)"),
            )),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn unservable_configs_are_refused() {
        let ok = crate::synth::tiny_config(97);
        ok.validate().unwrap();
        let mut c = ok.clone();
        c.max_position = 0;
        assert!(c.validate().unwrap_err().to_string().contains("max_position_embeddings"));
        let mut c = ok.clone();
        c.eos_token_ids = vec![c.vocab_size as u32];
        assert!(c.validate().unwrap_err().to_string().contains("eos_token_id"));
        let mut c = ok.clone();
        c.eos_token_ids = vec![];
        assert!(c.validate().is_err());
        // Through config.json too.
        let mut j = ok.to_hf_json();
        j["eos_token_id"] = serde_json::json!(1_000_000);
        let e = super::Config::from_json(&j).unwrap_err().to_string();
        assert!(e.contains("eos_token_id"), "{e}");
        // Ids beyond u32 are not truncated into the vocabulary.
        j["eos_token_id"] = serde_json::json!((1u64 << 32) + 1);
        assert!(super::Config::from_json(&j).is_err());
        let mut j = ok.to_hf_json();
        j["max_position_embeddings"] = serde_json::json!(0);
        assert!(super::Config::from_json(&j).unwrap_err().to_string().contains("max_position_embeddings"));
    }

    use super::*;

    #[test]
    fn yarn_table_matches_spec_for_base_160000() {
        let c = Config::flash();
        let f = c.rope_freqs(AttnKind::Csa);
        let expect = [
            1.000000e+00,
            6.876560e-01,
            4.728708e-01,
            3.251725e-01,
            2.236068e-01,
            1.537646e-01,
            1.057371e-01,
            7.271077e-02,
            5.000000e-02,
            3.438280e-02,
            2.364354e-02,
            1.625862e-02,
            1.118034e-02,
            7.688228e-03,
            5.286856e-03,
            3.635539e-03,
            2.265625e-03,
            1.396801e-03,
            8.496897e-04,
            5.080820e-04,
            2.969778e-04,
            1.681800e-04,
            9.086784e-05,
            4.544423e-05,
            1.953125e-05,
            5.372313e-06,
            3.694303e-06,
            2.540410e-06,
            1.746928e-06,
            1.201286e-06,
            8.260713e-07,
            5.680529e-07,
        ];
        assert_eq!(f.len(), 32);
        for (i, (a, b)) in f.iter().zip(expect).enumerate() {
            assert!(((a - b) / b).abs() < 1e-5, "pair {i}: {a} vs {b}");
        }
        // SWA layers: plain base 10000, no YaRN.
        let s = c.rope_freqs(AttnKind::Swa);
        assert!((s[31] - 10000f64.powf(-62.0 / 64.0)).abs() < 1e-15);
    }

    #[test]
    fn hf_json_round_trips() {
        for c in [Config::flash(), Config::pro()] {
            let back = Config::from_json(&c.to_hf_json()).unwrap();
            assert_eq!(back, c);
        }
    }

    #[test]
    fn unknown_layer_type_names_the_field() {
        let mut j = Config::flash().to_hf_json();
        j["layer_types"][5] = "dense_attention".into();
        let e = Config::from_json(&j).unwrap_err().to_string();
        assert!(e.contains("layer_types[5]") && e.contains("dense_attention"), "{e}");
    }

    #[test]
    fn wrong_type_and_inconsistent_values_name_the_field() {
        let mut j = Config::flash().to_hf_json();
        j["hidden_size"] = "big".into();
        assert!(Config::from_json(&j).unwrap_err().to_string().contains("hidden_size"));
        let mut j = Config::flash().to_hf_json();
        j["o_groups"] = 7.into();
        assert!(Config::from_json(&j).unwrap_err().to_string().contains("o_groups"));
        let mut j = Config::flash().to_hf_json();
        j["num_experts_per_tok"] = 300.into();
        assert!(Config::from_json(&j).unwrap_err().to_string().contains("num_experts_per_tok"));
    }

    #[test]
    fn official_layout_parses() {
        let ratios: Vec<usize> =
            [0, 0].into_iter().chain((2..43).map(|i| if i % 2 == 0 { 4 } else { 128 })).chain([0]).collect();
        let j = serde_json::json!({
            "vocab_size": 129280, "dim": 4096, "moe_inter_dim": 2048, "n_layers": 43, "n_hash_layers": 3,
            "n_mtp_layers": 1, "n_heads": 64, "n_routed_experts": 256, "n_shared_experts": 1,
            "n_activated_experts": 6, "score_func": "sqrtsoftplus", "route_scale": 1.5, "swiglu_limit": 10.0,
            "q_lora_rank": 1024, "head_dim": 512, "rope_head_dim": 64, "norm_eps": 1e-6, "o_groups": 8,
            "o_lora_rank": 1024, "window_size": 128, "compress_ratios": ratios, "compress_rope_theta": 160000.0,
            "rope_theta": 10000.0, "rope_factor": 16, "original_seq_len": 65536, "beta_fast": 32, "beta_slow": 1,
            "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20,
            "hc_eps": 1e-6, "dtype": "fp8", "expert_dtype": "fp4"
        });
        let c = Config::from_json(&j).unwrap();
        let mut flash = Config::flash();
        flash.layout = Layout::Official;
        assert_eq!(c, flash);
        let mut bad = j.clone();
        bad["compress_ratios"][7] = 2.into();
        assert!(Config::from_json(&bad).unwrap_err().to_string().contains("compress_ratios[7]"));
    }
}
