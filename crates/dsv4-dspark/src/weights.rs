//! The DSpark tensors (`mtp.<s>.*`, spec §3.7) and their loader.

use dsv4_backend::cpu::Tensor;
use dsv4_model::quant::{dequant_fp4, dequant_fp8_blocks};
use dsv4_model::weights::{Expert, Hc};
use dsv4_model::{Config, DType, LoadError, TensorStore};

use crate::{DsparkConfig, DsparkError};

/// DSparkAttention weights of one stage: SWA-only MLA, no compressor, no indexer.
pub struct StageAttention<W = Tensor> {
    pub wq_a: W,
    pub q_norm: W,
    pub wq_b: W,
    pub wkv: W,
    pub kv_norm: W,
    pub wo_a: W,
    pub wo_b: W,
    pub sinks: W,
}

/// The score-routed draft MoE of one stage.
pub struct StageMoe<W = Tensor> {
    pub gate: W,
    pub bias: W,
    pub experts: Vec<Expert<W>>,
    pub shared: Expert<W>,
}

/// One draft stage `mtp.<s>`: a V4 block whose attention is DSparkAttention.
pub struct StageWeights<W = Tensor> {
    pub attn_norm: W,
    pub ffn_norm: W,
    pub hc_attn: Hc<W>,
    pub hc_ffn: Hc<W>,
    pub attn: StageAttention<W>,
    pub ffn: StageMoe<W>,
}

/// Heads of the last stage.
pub struct HeadWeights<W = Tensor> {
    /// `mtp.<last>.norm.weight` (before the shared LM head).
    pub norm: W,
    pub hc_head: Hc<W>,
    /// `markov_w1 [V, r]`: embedding table of the previous token.
    pub markov_w1: W,
    /// `markov_w2 [V, r]`: applied as r → V (`bias = W2 · W1[prev]`).
    pub markov_w2: W,
    /// `confidence_head.proj.weight [1, d + r]` (no bias) split at `d`: the part applied to the
    /// head hidden `[1, d]` and the part applied to the Markov embedding `[1, r]`.
    pub conf_h: W,
    pub conf_e: W,
}

/// Everything the drafter reads: shared embedding/head (copies of the target's), the context
/// fusion of `mtp.0`, the stages and the last stage's heads.
pub struct DrafterWeights<W = Tensor> {
    pub embed: W,
    pub head: W,
    /// `mtp.0.main_proj.weight [d, n_capture·d]`.
    pub main_proj: W,
    pub main_norm: W,
    pub stages: Vec<StageWeights<W>>,
    pub heads: HeadWeights<W>,
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
    let conf = read(store, &format!("{p}.confidence_head.proj.weight"), &[1, d + r], false)?;
    let heads = HeadWeights {
        norm: read(store, &format!("{p}.norm.weight"), &[d], false)?,
        hc_head: hc(store, &p, "hc_head", hcn, hcw, 1)?,
        markov_w1: read(store, &format!("{p}.markov_head.markov_w1.weight"), &[v, r], false)?,
        markov_w2: read(store, &format!("{p}.markov_head.markov_w2.weight"), &[v, r], false)?,
        conf_h: Tensor::new(1, d, conf.data[..d].to_vec()),
        conf_e: Tensor::new(1, r, conf.data[d..].to_vec()),
    };
    Ok(DrafterWeights { embed, head, main_proj, main_norm, stages, heads })
}

/// One drafter tensor as [`DrafterWeights::walk`] asks for it: its name, logical shape (`[n]`
/// for vectors) and the distribution synthetic weights draw it from (spec of
/// `dsv4_model::synth`: matrices N(0, fan_in^-½), norms N(1, 0.1), mHC base N(0, 0.5) and
/// scale N(1, 0.2), sinks N(0, 1), router biases N(0, 0.1), embedding N(0, 1)).
///
/// Names are the official ones (so a backend's bf16 rule,
/// [`dsv4_backend::bf16::is_bf16_weight`], applies as to the target), with two exceptions:
/// `markov_w1` is a gather table like the embedding and is named without `.weight`, so it stays
/// f32 (a device gather reads f32 rows); the confidence weight is two tensors, its `[1, d]` and
/// `[1, r]` parts.
pub struct Slot<'a> {
    pub name: String,
    pub shape: &'a [usize],
    pub mean: f32,
    pub std: f32,
}

/// `(name, shape, mean, std) -> tensor`.
type MakeFn<'a, W, E> = dyn FnMut(String, &[usize], f32, f32) -> Result<W, E> + 'a;

impl<W> DrafterWeights<W> {
    /// Builds every tensor of a drafter with `stages` stages from `get(slot)`, in a fixed order
    /// (the order of [`Self::into_vec`]).
    pub fn walk<E>(
        cfg: &Config,
        dcfg: &DsparkConfig,
        stages: usize,
        mut get: impl FnMut(Slot) -> Result<W, E>,
    ) -> Result<Self, E> {
        let (d, v, h, hd) = (cfg.hidden, cfg.vocab_size, cfg.n_heads, cfg.head_dim);
        let (hcw, mix, hcn) = (cfg.hc_width(), cfg.hc_mix(), cfg.hc_mult);
        let (ncap, r) = (dcfg.target_layer_ids.len(), dcfg.markov_rank);
        let mut t = |name: String, shape: &[usize], mean: f32, std: f32| get(Slot { name, shape, mean, std });
        let m = |t: &mut MakeFn<W, E>, name: String, rows: usize, cols: usize| {
            t(name, &[rows, cols], 0.0, (cols as f32).powf(-0.5))
        };
        let embed = t("embed.weight".into(), &[v, d], 0.0, 1.0)?;
        let head = m(&mut t, "head.weight".into(), v, d)?;
        let main_proj = m(&mut t, "mtp.0.main_proj.weight".into(), d, ncap * d)?;
        let main_norm = t("mtp.0.main_norm.weight".into(), &[d], 1.0, 0.1)?;
        let mut st = Vec::with_capacity(stages);
        for s in 0..stages {
            let p = format!("mtp.{s}");
            let hc = |t: &mut MakeFn<W, E>, which: &str| -> Result<Hc<W>, E> {
                Ok(Hc {
                    fn_: t(format!("{p}.hc_{which}_fn"), &[mix, hcw], 0.0, (hcw as f32).powf(-0.5))?,
                    base: t(format!("{p}.hc_{which}_base"), &[mix], 0.0, 0.5)?,
                    scale: t(format!("{p}.hc_{which}_scale"), &[3], 1.0, 0.2)?,
                })
            };
            let hc_attn = hc(&mut t, "attn")?;
            let hc_ffn = hc(&mut t, "ffn")?;
            let attn_norm = t(format!("{p}.attn_norm.weight"), &[d], 1.0, 0.1)?;
            let ffn_norm = t(format!("{p}.ffn_norm.weight"), &[d], 1.0, 0.1)?;
            let a = format!("{p}.attn");
            let og = cfg.o_groups;
            let attn = StageAttention {
                wq_a: m(&mut t, format!("{a}.wq_a.weight"), cfg.q_lora_rank, d)?,
                q_norm: t(format!("{a}.q_norm.weight"), &[cfg.q_lora_rank], 1.0, 0.1)?,
                wq_b: m(&mut t, format!("{a}.wq_b.weight"), h * hd, cfg.q_lora_rank)?,
                wkv: m(&mut t, format!("{a}.wkv.weight"), hd, d)?,
                kv_norm: t(format!("{a}.kv_norm.weight"), &[hd], 1.0, 0.1)?,
                wo_a: m(&mut t, format!("{a}.wo_a.weight"), og * cfg.o_lora_rank, h * hd / og)?,
                wo_b: m(&mut t, format!("{a}.wo_b.weight"), d, og * cfg.o_lora_rank)?,
                sinks: t(format!("{a}.attn_sink"), &[h], 0.0, 1.0)?,
            };
            let f = format!("{p}.ffn");
            let (ne, inter) = (cfg.n_routed_experts, cfg.moe_inter);
            let gate = m(&mut t, format!("{f}.gate.weight"), ne, d)?;
            let bias = t(format!("{f}.gate.bias"), &[ne], 0.0, 0.1)?;
            let expert = |t: &mut MakeFn<W, E>, x: String| -> Result<Expert<W>, E> {
                Ok(Expert {
                    w1: m(t, format!("{x}.w1.weight"), inter, d)?,
                    w2: m(t, format!("{x}.w2.weight"), d, inter)?,
                    w3: m(t, format!("{x}.w3.weight"), inter, d)?,
                })
            };
            let experts = (0..ne).map(|e| expert(&mut t, format!("{f}.experts.{e}"))).collect::<Result<_, E>>()?;
            let shared = expert(&mut t, format!("{f}.shared_experts"))?;
            st.push(StageWeights {
                attn_norm,
                ffn_norm,
                hc_attn,
                hc_ffn,
                attn,
                ffn: StageMoe { gate, bias, experts, shared },
            });
        }
        let p = format!("mtp.{}", stages - 1);
        let heads = HeadWeights {
            norm: t(format!("{p}.norm.weight"), &[d], 1.0, 0.1)?,
            hc_head: Hc {
                fn_: t(format!("{p}.hc_head_fn"), &[hcn, hcw], 0.0, (hcw as f32).powf(-0.5))?,
                base: t(format!("{p}.hc_head_base"), &[hcn], 0.0, 0.5)?,
                scale: t(format!("{p}.hc_head_scale"), &[1], 1.0, 0.2)?,
            },
            markov_w1: m(&mut t, format!("{p}.markov_head.markov_w1"), v, r)?,
            markov_w2: m(&mut t, format!("{p}.markov_head.markov_w2.weight"), v, r)?,
            conf_h: t(format!("{p}.confidence_head.proj.weight"), &[1, d], 0.0, ((d + r) as f32).powf(-0.5))?,
            conf_e: t(format!("{p}.confidence_head.proj.weight"), &[1, r], 0.0, ((d + r) as f32).powf(-0.5))?,
        };
        Ok(DrafterWeights { embed, head, main_proj, main_norm, stages: st, heads })
    }

    /// Every tensor in [`Self::walk`]'s order.
    pub fn into_vec(self) -> Vec<W> {
        let mut v = vec![self.embed, self.head, self.main_proj, self.main_norm];
        for s in self.stages {
            v.extend([s.hc_attn.fn_, s.hc_attn.base, s.hc_attn.scale, s.hc_ffn.fn_, s.hc_ffn.base, s.hc_ffn.scale]);
            v.extend([s.attn_norm, s.ffn_norm]);
            let a = s.attn;
            v.extend([a.wq_a, a.q_norm, a.wq_b, a.wkv, a.kv_norm, a.wo_a, a.wo_b, a.sinks]);
            v.extend([s.ffn.gate, s.ffn.bias]);
            for e in s.ffn.experts.into_iter().chain([s.ffn.shared]) {
                v.extend([e.w1, e.w2, e.w3]);
            }
        }
        let h = self.heads;
        v.extend([
            h.norm,
            h.hc_head.fn_,
            h.hc_head.base,
            h.hc_head.scale,
            h.markov_w1,
            h.markov_w2,
            h.conf_h,
            h.conf_e,
        ]);
        v
    }

    /// Converts every tensor with `f(slot, tensor)` (upload to a backend, bf16 rounding, ...).
    pub fn map<V, E>(
        self,
        cfg: &Config,
        dcfg: &DsparkConfig,
        mut f: impl FnMut(Slot, W) -> Result<V, E>,
    ) -> Result<DrafterWeights<V>, E> {
        let n = self.stages.len();
        let mut it = self.into_vec().into_iter();
        DrafterWeights::walk(cfg, dcfg, n, |slot| f(slot, it.next().expect("one tensor per slot")))
    }
}

impl DrafterWeights<Tensor> {
    /// Uploads every tensor to `b` (`B::upload` with the names of [`Slot`]).
    pub fn upload<B: dsv4_backend::Backend>(
        self,
        b: &B,
        cfg: &Config,
        dcfg: &DsparkConfig,
    ) -> Result<DrafterWeights<B::W>, LoadError> {
        self.map(cfg, dcfg, |slot, t| b.upload(dsv4_model::HostTensor::new(slot.name, slot.shape.to_vec(), t.data)))
    }

    /// Every tensor a bf16 backend stores in bf16 rounded to bf16 (the CPU twin of a bf16 GPU
    /// drafter, for tests).
    pub fn round_bf16(self, cfg: &Config, dcfg: &DsparkConfig) -> Self {
        let r: Result<Self, std::convert::Infallible> = self.map(cfg, dcfg, |slot, mut t| {
            if dsv4_backend::bf16::is_bf16_weight(&slot.name, slot.shape) {
                t.data.iter_mut().for_each(|v| *v = dsv4_backend::bf16::round_bf16(*v));
            }
            Ok(t)
        });
        match r {
            Ok(w) => w,
        }
    }
}
