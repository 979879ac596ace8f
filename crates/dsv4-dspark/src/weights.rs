//! The DSpark tensors (`mtp.<s>.*`, spec §3.7) and their loader.

use dsv4_backend::cpu::Tensor;
use dsv4_model::quant::{dequant_fp4, dequant_fp8_blocks};
use dsv4_model::weights::{Expert, Hc};
use dsv4_model::{Config, DType, LoadError, TensorStore};

use crate::{DsparkConfig, DsparkError};

/// DSparkAttention weights of one stage: SWA-only MLA, no compressor, no indexer.
pub struct StageAttention {
    pub wq_a: Tensor,
    pub q_norm: Tensor,
    pub wq_b: Tensor,
    pub wkv: Tensor,
    pub kv_norm: Tensor,
    pub wo_a: Tensor,
    pub wo_b: Tensor,
    pub sinks: Tensor,
}

/// The score-routed draft MoE of one stage.
pub struct StageMoe {
    pub gate: Tensor,
    pub bias: Tensor,
    pub experts: Vec<Expert<Tensor>>,
    pub shared: Expert<Tensor>,
}

/// One draft stage `mtp.<s>`: a V4 block whose attention is DSparkAttention.
pub struct StageWeights {
    pub attn_norm: Tensor,
    pub ffn_norm: Tensor,
    pub hc_attn: Hc<Tensor>,
    pub hc_ffn: Hc<Tensor>,
    pub attn: StageAttention,
    pub ffn: StageMoe,
}

/// Heads of the last stage.
pub struct HeadWeights {
    /// `mtp.<last>.norm.weight` (before the shared LM head).
    pub norm: Tensor,
    pub hc_head: Hc<Tensor>,
    /// `markov_w1 [V, r]`: embedding table of the previous token.
    pub markov_w1: Tensor,
    /// `markov_w2 [V, r]`: applied as r → V (`bias = W2 · W1[prev]`).
    pub markov_w2: Tensor,
    /// `confidence_head.proj.weight [1, d + r]`, no bias.
    pub conf: Tensor,
}

/// Everything the drafter reads: shared embedding/head (copies of the target's), the context
/// fusion of `mtp.0`, the stages and the last stage's heads.
pub struct DrafterWeights {
    pub embed: Tensor,
    pub head: Tensor,
    /// `mtp.0.main_proj.weight [d, n_capture·d]`.
    pub main_proj: Tensor,
    pub main_norm: Tensor,
    pub stages: Vec<StageWeights>,
    pub heads: HeadWeights,
}

/// Number of contiguous `mtp.<i>.` stages in the checkpoint (0 if none).
pub fn count_stages(store: &TensorStore) -> usize {
    let mut seen = std::collections::BTreeSet::new();
    for n in store.names() {
        let n = n.strip_prefix("model.").unwrap_or(n);
        if let Some(rest) = n.strip_prefix("mtp.") {
            if let Some(i) = rest.split('.').next().and_then(|s| s.parse::<usize>().ok()) {
                seen.insert(i);
            }
        }
    }
    (0..).take_while(|i| seen.contains(i)).count()
}

fn resolve(store: &TensorStore, name: &str) -> Option<String> {
    [name.to_string(), format!("model.{name}")].into_iter().find(|n| store.contains(n))
}

/// Reads `name` with the logical `shape`: any float dtype, FP8 E4M3 with 128×128 block scales,
/// or (when `fp4_ok`, routed experts) FP4 E2M1 packed two per byte with per-32 scales.
fn read(store: &TensorStore, name: &str, shape: &[usize], fp4_ok: bool) -> Result<Tensor, DsparkError> {
    let found_name = resolve(store, name)
        .ok_or_else(|| LoadError::Missing { name: name.to_string(), tried: format!("{name}, model.{name}") })?;
    let info = store.info(&found_name).expect("resolved");
    let (rows, cols) = match shape {
        [c] => (1, *c),
        [r, c] => (*r, *c),
        _ => unreachable!("DSpark tensors are 1-D or 2-D"),
    };
    let scale_name = || {
        [format!("{}.scale", found_name.trim_end_matches(".weight")), format!("{found_name}_scale_inv")]
            .into_iter()
            .find(|s| store.contains(s))
            .ok_or_else(|| LoadError::Missing {
                name: format!("{found_name} scale"),
                tried: format!("{}.scale", found_name.trim_end_matches(".weight")),
            })
    };
    let shape_err =
        |expected: Vec<usize>| LoadError::Shape { name: found_name.clone(), expected, found: info.shape.clone() };
    let data = match info.dtype {
        DType::F8E4M3 if shape.len() == 2 => {
            if info.shape != shape {
                return Err(shape_err(shape.to_vec()).into());
            }
            let sn = scale_name()?;
            let sshape = vec![rows.div_ceil(128), cols.div_ceil(128)];
            let si = store.info(&sn).expect("found");
            if si.shape != sshape {
                return Err(LoadError::Shape { name: sn, expected: sshape, found: si.shape.clone() }.into());
            }
            dequant_fp8_blocks(store.raw(&found_name)?, &store.f32(&sn)?, rows, cols, 128)
        }
        DType::I8 | DType::U8 if fp4_ok && shape.len() == 2 && cols % 2 == 0 => {
            if info.shape != [rows, cols / 2] {
                return Err(shape_err(vec![rows, cols / 2]).into());
            }
            let sn = scale_name()?;
            let sshape = vec![rows, cols.div_ceil(32)];
            let si = store.info(&sn).expect("found");
            if si.shape != sshape {
                return Err(LoadError::Shape { name: sn, expected: sshape, found: si.shape.clone() }.into());
            }
            dequant_fp4(store.raw(&found_name)?, &store.f32(&sn)?, rows, cols, 32)
        }
        dt if dt.is_float() => {
            if info.shape != shape {
                return Err(shape_err(shape.to_vec()).into());
            }
            store.f32(&found_name)?
        }
        dt => {
            return Err(LoadError::DType {
                name: found_name.clone(),
                expected: "a float type (F32, BF16, F16, F8_E4M3 + scale)".into(),
                found: dt.name().into(),
            }
            .into())
        }
    };
    Ok(Tensor::new(rows, cols, data))
}

fn hc(
    store: &TensorStore,
    p: &str,
    which: &str,
    rows: usize,
    width: usize,
    nscale: usize,
) -> Result<Hc<Tensor>, DsparkError> {
    Ok(Hc {
        fn_: read(store, &format!("{p}.{which}_fn"), &[rows, width], false)?,
        base: read(store, &format!("{p}.{which}_base"), &[rows], false)?,
        scale: read(store, &format!("{p}.{which}_scale"), &[nscale], false)?,
    })
}

fn expert(store: &TensorStore, p: &str, inter: usize, d: usize, fp4_ok: bool) -> Result<Expert<Tensor>, DsparkError> {
    Ok(Expert {
        w1: read(store, &format!("{p}.w1.weight"), &[inter, d], fp4_ok)?,
        w2: read(store, &format!("{p}.w2.weight"), &[d, inter], fp4_ok)?,
        w3: read(store, &format!("{p}.w3.weight"), &[inter, d], fp4_ok)?,
    })
}

/// Checks that the checkpoint carries a DSpark module (spec §2.3 detection rules) and returns the
/// stage count. A serial-MTP checkpoint (`mtp.0.e_proj`, no `main_proj`) is refused, never
/// silently used as a drafter.
pub fn detect(store: &TensorStore) -> Result<usize, DsparkError> {
    let has = |n: &str| resolve(store, n).is_some();
    let n = count_stages(store);
    if !has("mtp.0.main_proj.weight") {
        if has("mtp.0.e_proj.weight") || has("mtp.0.h_proj.weight") {
            return Err(DsparkError::SerialMtp { stages: n });
        }
        return Err(DsparkError::NotDspark(if n == 0 {
            "the checkpoint has no `mtp.*` tensors".into()
        } else {
            format!("`mtp.0.main_proj.weight` is missing ({n} mtp stage(s) found)")
        }));
    }
    let last = n - 1;
    if !has(&format!("mtp.{last}.markov_head.markov_w1.weight")) {
        return Err(DsparkError::NotDspark(format!(
            "`mtp.{last}.markov_head.markov_w1.weight` is missing (the last of {n} stages has no Markov head)"
        )));
    }
    Ok(n)
}

/// Loads the drafter from a checkpoint whose target config is `cfg`.
pub fn load(store: &TensorStore, cfg: &Config, dcfg: &DsparkConfig) -> Result<DrafterWeights, DsparkError> {
    let n = detect(store)?;
    let (d, v, hd, h) = (cfg.hidden, cfg.vocab_size, cfg.head_dim, cfg.n_heads);
    let (hcw, mix, hcn) = (cfg.hc_width(), cfg.hc_mix(), cfg.hc_mult);
    let ncap = dcfg.target_layer_ids.len();
    let r = dcfg.markov_rank;
    // The drafter shares the target's embedding and LM head: official names, else HF names.
    let shared = |official: &str, hf: &str| {
        if resolve(store, official).is_none() && resolve(store, hf).is_some() {
            hf.to_string()
        } else {
            official.to_string()
        }
    };
    let embed = read(store, &shared("embed.weight", "embed_tokens.weight"), &[v, d], false)?;
    let head = read(store, &shared("head.weight", "lm_head.weight"), &[v, d], false)?;
    let main_proj = read(store, "mtp.0.main_proj.weight", &[d, ncap * d], false)?;
    let main_norm = read(store, "mtp.0.main_norm.weight", &[d], false)?;
    let mut stages = Vec::with_capacity(n);
    for s in 0..n {
        let p = format!("mtp.{s}");
        for bad in ["attn.compressor.wkv.weight", "attn.indexer.wq_b.weight", "ffn.gate.tid2eid"] {
            if resolve(store, &format!("{p}.{bad}")).is_some() {
                return Err(DsparkError::NotDspark(format!(
                    "`{p}.{bad}` exists, but DSpark stages are SWA-only and score-routed"
                )));
            }
        }
        let a = format!("{p}.attn");
        let attn = StageAttention {
            wq_a: read(store, &format!("{a}.wq_a.weight"), &[cfg.q_lora_rank, d], false)?,
            q_norm: read(store, &format!("{a}.q_norm.weight"), &[cfg.q_lora_rank], false)?,
            wq_b: read(store, &format!("{a}.wq_b.weight"), &[h * hd, cfg.q_lora_rank], false)?,
            wkv: read(store, &format!("{a}.wkv.weight"), &[hd, d], false)?,
            kv_norm: read(store, &format!("{a}.kv_norm.weight"), &[hd], false)?,
            wo_a: read(
                store,
                &format!("{a}.wo_a.weight"),
                &[cfg.o_groups * cfg.o_lora_rank, h * hd / cfg.o_groups],
                false,
            )?,
            wo_b: read(store, &format!("{a}.wo_b.weight"), &[d, cfg.o_groups * cfg.o_lora_rank], false)?,
            sinks: read(store, &format!("{a}.attn_sink"), &[h], false)?,
        };
        let f = format!("{p}.ffn");
        let (ne, inter) = (cfg.n_routed_experts, cfg.moe_inter);
        let ffn = StageMoe {
            gate: read(store, &format!("{f}.gate.weight"), &[ne, d], false)?,
            bias: read(store, &format!("{f}.gate.bias"), &[ne], false)?,
            experts: (0..ne)
                .map(|e| expert(store, &format!("{f}.experts.{e}"), inter, d, true))
                .collect::<Result<_, _>>()?,
            shared: expert(store, &format!("{f}.shared_experts"), inter, d, false)?,
        };
        stages.push(StageWeights {
            attn_norm: read(store, &format!("{p}.attn_norm.weight"), &[d], false)?,
            ffn_norm: read(store, &format!("{p}.ffn_norm.weight"), &[d], false)?,
            hc_attn: hc(store, &p, "hc_attn", mix, hcw, 3)?,
            hc_ffn: hc(store, &p, "hc_ffn", mix, hcw, 3)?,
            attn,
            ffn,
        });
    }
    let p = format!("mtp.{}", n - 1);
    let heads = HeadWeights {
        norm: read(store, &format!("{p}.norm.weight"), &[d], false)?,
        hc_head: hc(store, &p, "hc_head", hcn, hcw, 1)?,
        markov_w1: read(store, &format!("{p}.markov_head.markov_w1.weight"), &[v, r], false)?,
        markov_w2: read(store, &format!("{p}.markov_head.markov_w2.weight"), &[v, r], false)?,
        conf: read(store, &format!("{p}.confidence_head.proj.weight"), &[1, d + r], false)?,
    };
    Ok(DrafterWeights { embed, head, main_proj, main_norm, stages, heads })
}
