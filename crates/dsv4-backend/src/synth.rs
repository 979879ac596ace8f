//! Random weights built tensor by tensor through a backend callback (no checkpoint on disk):
//! `dsv4 bench --synthetic flash` draws full-size V4 weights directly on a GPU this way.
//!
//! Names, shapes and distributions follow `dsv4_model::synth::random_checkpoint` (matrices
//! N(0, fan_in^-1/2), norms N(1, 0.1), mHC base N(0, 0.5) and scale N(1, 0.2), sinks N(0, 1),
//! position biases N(0, 0.5), router biases N(0, 0.1)); tensors carry their official names so a
//! backend's storage rule ([`crate::bf16::is_bf16_weight`]) applies as on load.

use dsv4_model::weights::{Attention, Compressor, Expert, Hc, Indexer, Layer, Moe};
use dsv4_model::{AttnKind, Config, Weights};

/// `(name, shape, mean, std) -> tensor`.
pub type Mk<'a, W> = dyn FnMut(&str, &[usize], f32, f32) -> W + 'a;

/// Layer `l`'s mHC weights `layers.{l}.hc_{which}_{fn,base,scale}` (`rows` mixing rows over
/// `cfg`'s flattened residual state, `nscale` scales), drawn as
/// `dsv4_model::synth::random_checkpoint` draws them.
pub fn hc_weights<W>(t: &mut Mk<W>, cfg: &Config, l: usize, which: &str, rows: usize, nscale: usize) -> Hc<W> {
    let (p, hcw) = (format!("layers.{l}"), cfg.hc_width());
    Hc {
        fn_: t(&format!("{p}.hc_{which}_fn"), &[rows, hcw], 0.0, (hcw as f32).powf(-0.5)),
        base: t(&format!("{p}.hc_{which}_base"), &[rows], 0.0, 0.5),
        scale: t(&format!("{p}.hc_{which}_scale"), &[nscale], 1.0, 0.2),
    }
}

/// Builds every tensor `cfg` calls for with `mk(name, shape, mean, std, seed)`.
pub fn synth_weights<W>(cfg: &Config, seed: u64, mut mk: impl FnMut(&str, &[usize], f32, f32, u64) -> W) -> Weights<W> {
    let mut n = 0u64;
    let mut t = |name: &str, shape: &[usize], mean: f32, std: f32| {
        n += 1;
        mk(name, shape, mean, std, seed.wrapping_mul(1_000_003).wrapping_add(n))
    };
    let mat = |t: &mut Mk<W>, name: &str, r: usize, c: usize| t(name, &[r, c], 0.0, (c as f32).powf(-0.5));
    let (d, h, hd) = (cfg.hidden, cfg.n_heads, cfg.head_dim);
    let (hcw, mix) = (cfg.hc_width(), cfg.hc_mix());
    let embed = t("embed.weight", &[cfg.vocab_size, d], 0.0, 1.0);
    let mut layers = Vec::new();
    for (l, spec) in cfg.layers.iter().enumerate() {
        let p = format!("layers.{l}");
        let hc_attn = hc_weights(&mut t, cfg, l, "attn", mix, 3);
        let hc_ffn = hc_weights(&mut t, cfg, l, "ffn", mix, 3);
        let attn_norm = t(&format!("{p}.attn_norm.weight"), &[d], 1.0, 0.1);
        let ffn_norm = t(&format!("{p}.ffn_norm.weight"), &[d], 1.0, 0.1);
        let a = format!("{p}.attn");
        let comp = |t: &mut Mk<W>, c: &str, width: usize, head: usize| Compressor {
            wkv: mat(t, &format!("{c}.wkv.weight"), width, d),
            wgate: mat(t, &format!("{c}.wgate.weight"), width, d),
            ape: t(&format!("{c}.ape"), &[spec.ratio, width], 0.0, 0.5),
            norm: t(&format!("{c}.norm.weight"), &[head], 1.0, 0.1),
        };
        let (compressor, indexer) = match spec.attn {
            AttnKind::Swa => (None, None),
            AttnKind::Hca => (Some(comp(&mut t, &format!("{a}.compressor"), hd, hd)), None),
            AttnKind::Csa => {
                let c = comp(&mut t, &format!("{a}.compressor"), 2 * hd, hd);
                let (ih, id) = (cfg.index_n_heads, cfg.index_head_dim);
                let ix = format!("{a}.indexer");
                let compressor = comp(&mut t, &format!("{ix}.compressor"), 2 * id, id);
                let ix = Indexer {
                    wq_b: mat(&mut t, &format!("{ix}.wq_b.weight"), ih * id, cfg.q_lora_rank),
                    weights_proj: mat(&mut t, &format!("{ix}.weights_proj.weight"), ih, d),
                    compressor,
                };
                (Some(c), Some(ix))
            }
        };
        let og = cfg.o_groups;
        let attn = Attention {
            wq_a: mat(&mut t, &format!("{a}.wq_a.weight"), cfg.q_lora_rank, d),
            q_norm: t(&format!("{a}.q_norm.weight"), &[cfg.q_lora_rank], 1.0, 0.1),
            wq_b: mat(&mut t, &format!("{a}.wq_b.weight"), h * hd, cfg.q_lora_rank),
            wkv: mat(&mut t, &format!("{a}.wkv.weight"), hd, d),
            kv_norm: t(&format!("{a}.kv_norm.weight"), &[hd], 1.0, 0.1),
            wo_a: mat(&mut t, &format!("{a}.wo_a.weight"), og * cfg.o_lora_rank, h * hd / og),
            wo_b: mat(&mut t, &format!("{a}.wo_b.weight"), d, og * cfg.o_lora_rank),
            sinks: t(&format!("{a}.attn_sink"), &[h], 0.0, 1.0),
            compressor,
            indexer,
        };
        let f = format!("{p}.ffn");
        let (ne, k, inter) = (cfg.n_routed_experts, cfg.n_experts_per_tok, cfg.moe_inter);
        let gate = mat(&mut t, &format!("{f}.gate.weight"), ne, d);
        let (bias, tid2eid) = if spec.hash_moe {
            // A fixed pseudo-random choice of k distinct experts per token.
            let mut s = seed ^ (l as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let mut ids = Vec::with_capacity(cfg.vocab_size * k);
            for _ in 0..cfg.vocab_size {
                let mut chosen: Vec<u32> = Vec::with_capacity(k);
                while chosen.len() < k {
                    s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let e = ((s >> 33) % ne as u64) as u32;
                    if !chosen.contains(&e) {
                        chosen.push(e);
                    }
                }
                ids.extend(chosen);
            }
            (None, Some(ids))
        } else {
            (Some(t(&format!("{f}.gate.bias"), &[ne], 0.0, 0.1)), None)
        };
        let experts = (0..ne)
            .map(|e| {
                let x = format!("{f}.experts.{e}");
                Expert {
                    w1: mat(&mut t, &format!("{x}.w1.weight"), inter, d),
                    w2: mat(&mut t, &format!("{x}.w2.weight"), d, inter),
                    w3: mat(&mut t, &format!("{x}.w3.weight"), inter, d),
                }
            })
            .collect();
        let s = format!("{f}.shared_experts");
        let shared = Expert {
            w1: mat(&mut t, &format!("{s}.w1.weight"), inter, d),
            w2: mat(&mut t, &format!("{s}.w2.weight"), d, inter),
            w3: mat(&mut t, &format!("{s}.w3.weight"), inter, d),
        };
        layers.push(Layer {
            attn_norm,
            ffn_norm,
            hc_attn,
            hc_ffn,
            attn,
            ffn: Moe { gate, bias, tid2eid, experts, expert0: 0, shared },
        });
    }
    let norm = t("norm.weight", &[d], 1.0, 0.1);
    let hc_head = Hc {
        fn_: t("hc_head_fn", &[cfg.hc_mult, hcw], 0.0, (hcw as f32).powf(-0.5)),
        base: t("hc_head_base", &[cfg.hc_mult], 0.0, 0.5),
        scale: t("hc_head_scale", &[1], 1.0, 0.2),
    };
    let head = mat(&mut t, "head.weight", cfg.vocab_size, d);
    Weights { embed, head, norm, hc_head, layers }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Same tensors, names and shapes as the checkpoint loader produces for the same config.
    #[test]
    fn matches_loader_layout() {
        let cfg = dsv4_model::synth::tiny_config(64);
        let mut names = Vec::new();
        let w = synth_weights(&cfg, 1, |name, shape, _, _, _| {
            names.push(name.to_string());
            shape.to_vec()
        });
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), serde_json::to_string(&cfg.to_hf_json()).unwrap()).unwrap();
        let raw = dsv4_model::synth::random_checkpoint(&cfg, 1, dsv4_model::synth::SynthDType::F32);
        dsv4_model::store::write_safetensors(&dir.path().join("model.safetensors"), &raw).unwrap();
        let store = dsv4_model::TensorStore::open(dir.path()).unwrap();
        let mut loaded = Vec::new();
        let lw = dsv4_model::load_weights(&store, &cfg, false, |t| {
            loaded.push(t.name.clone());
            Ok(t.shape.clone())
        })
        .unwrap();
        let strip = |n: &String| n.trim_start_matches("model.").to_string();
        let mut a: Vec<String> = names.iter().map(strip).collect();
        let mut b: Vec<String> = loaded.iter().map(strip).collect();
        a.sort();
        b.sort();
        assert_eq!(a, b);
        assert_eq!(w.layers[1].attn.wq_b, lw.layers[1].attn.wq_b);
        assert_eq!(w.layers[2].ffn.experts[3].w2, lw.layers[2].ffn.experts[3].w2);
        assert_eq!(w.layers[0].ffn.tid2eid.as_ref().unwrap().len(), lw.layers[0].ffn.tid2eid.as_ref().unwrap().len());
    }
}
