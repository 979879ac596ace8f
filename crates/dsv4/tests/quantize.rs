//! `dsv4 quantize` → GGUF → `dsv4 logits --model X.gguf`: the GGUF's logits equal bitwise those
//! of its tensors dequantised into an f32 safetensors checkpoint, stay within a stated tolerance of
//! the original f32 model, and bad GGUFs give clear errors.

use dsv4_model::gguf::{gguf_experts, gguf_to_official, GgmlType, GgufFile, GgufValue};
use dsv4_model::gguf_write::GgufWriter;
use dsv4_model::store::{f32_bytes, write_safetensors, DType};
use dsv4_model::synth::{random_checkpoint, tiny_config, SynthDType};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn dsv4(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dsv4")).args(args).env("RUST_LOG", "warn").output().unwrap()
}

/// Runs a command that must succeed; returns its stderr.
fn ok(args: &[&str]) -> String {
    let o = dsv4(args);
    assert!(o.status.success(), "dsv4 {args:?} failed: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stderr).unwrap() + &String::from_utf8(o.stdout).unwrap()
}

fn fails(args: &[&str]) -> String {
    let o = dsv4(args);
    assert!(!o.status.success(), "dsv4 {args:?} should have failed");
    String::from_utf8(o.stderr).unwrap()
}

fn read_npy(p: &Path) -> Vec<f32> {
    let b = std::fs::read(p).unwrap();
    let hl = u16::from_le_bytes([b[8], b[9]]) as usize;
    b[10 + hl..].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

const TOKENS: &str = "5,17,3,200,42,42,7,311,99,1,64,128,255,500,2,9";

fn logits(model: &Path, out: &Path) -> Vec<f32> {
    ok(&["logits", "--model", model.to_str().unwrap(), "--tokens", TOKENS, "--out", out.to_str().unwrap()]);
    read_npy(out)
}

/// A random f32 model whose widths allow K-quants (hidden 256, moe_inter 256), every layer type.
fn tiny_k_model(dir: &Path) {
    let mut cfg = tiny_config(512);
    cfg.hidden = 256;
    cfg.moe_inter = 256;
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&cfg.to_hf_json()).unwrap()).unwrap();
    write_safetensors(&dir.join("model.safetensors"), &random_checkpoint(&cfg, 7, SynthDType::F32)).unwrap();
}

/// Every tensor of a GGUF dequantised to f32 under its official name (experts unstacked; I32
/// hash tables as I64), with the GGUF's config.json: the same weights as plain safetensors.
fn dequantise(gguf: &Path, dir: &Path) {
    let g = GgufFile::open(gguf).unwrap();
    std::fs::create_dir_all(dir).unwrap();
    let cfg = g.metadata("dsv4.config_json").unwrap().as_str().unwrap();
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    let mut out = Vec::new();
    for t in g.tensors() {
        if let Some(e) = gguf_experts(&t.name) {
            let (ne, rows, cols) = (t.shape[0], t.shape[1], t.shape[2]);
            for x in 0..ne {
                let v = g.f32_rows(&t.name, x * rows, rows).unwrap();
                out.push((e.official(x), DType::F32, vec![rows, cols], f32_bytes(&v)));
            }
        } else if t.dtype == GgmlType::I32 {
            let v: Vec<u8> = g.i32(&t.name).unwrap().iter().flat_map(|&x| (x as i64).to_le_bytes()).collect();
            out.push((gguf_to_official(&t.name).unwrap(), DType::I64, t.shape.clone(), v));
        } else {
            let v = g.f32(&t.name).unwrap();
            out.push((gguf_to_official(&t.name).unwrap(), DType::F32, t.shape.clone(), f32_bytes(&v)));
        }
    }
    write_safetensors(&dir.join("model.safetensors"), &out).unwrap();
}

/// `‖a − b‖₂ / ‖b‖₂` and the fraction of positions whose argmax agrees.
fn compare(a: &[f32], b: &[f32], vocab: usize) -> (f64, f64) {
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        num += (*x as f64 - *y as f64).powi(2);
        den += (*y as f64).powi(2);
    }
    let argmax = |r: &[f32]| (0..r.len()).max_by(|&i, &j| r[i].total_cmp(&r[j])).unwrap();
    let rows = a.len() / vocab;
    let agree = (0..rows).filter(|&r| argmax(&a[r * vocab..][..vocab]) == argmax(&b[r * vocab..][..vocab])).count();
    ((num / den).sqrt(), agree as f64 / rows as f64)
}

fn bitwise_eq(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn quantised_tiny_models_load_and_match() {
    let tmp = tempfile::tempdir().unwrap();
    let t = |n: &str| -> PathBuf { tmp.path().join(n) };
    tiny_k_model(&t("f32"));
    let base = logits(&t("f32"), &t("f32.npy"));
    // Tolerances: relative L2 error of all logits vs the f32 model. Measured on this model
    // (seed 7): q4 0.197 (argmax agreement 13/16), q2 0.616 (5/16), from expert weight errors of
    // 0.071 (Q4_K) and, for q2, 0.330 (IQ2_XXS gate/up) and 0.297 (Q2_K down) on Gaussian
    // weights; a random 6-layer model has no redundancy and amplifies weight noise ~2-3x. Limits
    // leave ~1.3x headroom. (With Q2_K gate/up, before IQ2_XXS, q2 measured 0.593 at 2.625 instead
    // of 2.06 bits per gate/up weight.)
    for (fmt, tol) in [("q4", 0.3), ("q2", 0.8)] {
        let gguf = t(&format!("{fmt}.gguf"));
        let log = ok(&["quantize", "--in", s(&t("f32")), "--out", s(&gguf), "--experts", fmt]);
        // Tiny widths (q_lora 24, head_dim 32 ...) cannot all use the preferred types: listed.
        assert!(log.contains("fallback: blk.0.attn_q_b.weight: Q8_0 -> F16"), "{log}");
        assert_eq!(log.contains("IQ2_XXS"), fmt == "q2", "{log}");
        let g = GgufFile::open(&gguf).unwrap();
        // ds4's policy: q4 is Q4_K throughout; q2 is IQ2_XXS gate/up and Q2_K down.
        let (gate_up, down) =
            if fmt == "q4" { (GgmlType::Q4_K, GgmlType::Q4_K) } else { (GgmlType::IQ2_XXS, GgmlType::Q2_K) };
        for (n, want) in [
            ("blk.1.ffn_gate_exps.weight", gate_up),
            ("blk.1.ffn_up_exps.weight", gate_up),
            ("blk.1.ffn_down_exps.weight", down),
        ] {
            let i = g.info(n).unwrap();
            assert_eq!((i.dtype, i.shape.as_slice()), (want, &[8, 256, 256][..]), "{n}");
        }
        for (n, ty) in [
            ("token_embd.weight", GgmlType::F16),
            ("output.weight", GgmlType::Q8_0),
            ("blk.0.attn_q_a.weight", GgmlType::Q8_0),
            ("blk.0.ffn_gate_shexp.weight", GgmlType::Q8_0),
            ("blk.0.hc_attn_fn.weight", GgmlType::F16),
            ("blk.0.ffn_gate_inp.weight", GgmlType::F16),
            ("blk.1.attn_compressor_kv.weight", GgmlType::F16),
            ("blk.1.indexer.proj.weight", GgmlType::F16),
            ("blk.1.attn_compressor_ape.weight", GgmlType::F32),
            ("blk.0.attn_norm.weight", GgmlType::F32),
            ("blk.0.attn_sinks.weight", GgmlType::F32),
            ("blk.0.hc_attn_base.weight", GgmlType::F32),
            ("blk.4.exp_probs_b.bias", GgmlType::F32),
            ("blk.0.ffn_gate_tid2eid.weight", GgmlType::I32),
        ] {
            assert_eq!(g.info(n).unwrap_or_else(|| panic!("{n}")).dtype, ty, "{n}");
        }
        assert_eq!(g.metadata("general.architecture").and_then(GgufValue::as_str), Some("deepseek4"));
        let size = std::fs::metadata(&gguf).unwrap().len();
        eprintln!("{fmt}: {size} bytes");

        // Weight-level error of the stacked experts (each expert in its slot) and other types.
        let orig = dsv4_model::TensorStore::open(&t("f32")).unwrap();
        let gu = orig.f32("model.layers.1.mlp.experts.gate_up_proj").unwrap();
        let dn = orig.f32("model.layers.1.mlp.experts.down_proj").unwrap();
        let n = 256 * 256;
        let (mut gate, mut up) = (Vec::new(), Vec::new());
        for e in 0..8 {
            gate.extend_from_slice(&gu[2 * e * n..][..n]);
            up.extend_from_slice(&gu[(2 * e + 1) * n..][..n]);
        }
        let rel = |name: &str, want: &[f32]| compare(&g.f32(name).unwrap(), want, want.len()).0;
        let werr = [
            rel("blk.1.ffn_gate_exps.weight", &gate),
            rel("blk.1.ffn_up_exps.weight", &up),
            rel("blk.1.ffn_down_exps.weight", &dn),
            rel("output.weight", &orig.f32("lm_head.weight").unwrap()),
            rel("token_embd.weight", &orig.f32("model.embed_tokens.weight").unwrap()),
        ];
        eprintln!("{fmt}: weight relative L2 error gate/up/down/head(Q8_0)/embed(F16) {werr:.4?}");
        let wtol = if fmt == "q4" { 0.12 } else { 0.45 };
        assert!(werr[..3].iter().all(|&e| e > 0.0 && e < wtol), "{fmt}: expert weight errors {werr:?}");
        assert!(werr[3] < 0.01 && werr[4] < 1e-3, "{fmt}: {werr:?}");

        // (a) the GGUF's logits equal bitwise those of its weights dequantised into safetensors.
        let q = logits(&gguf, &t(&format!("{fmt}.npy")));
        dequantise(&gguf, &t(&format!("{fmt}-deq")));
        let d = logits(&t(&format!("{fmt}-deq")), &t(&format!("{fmt}-deq.npy")));
        assert!(bitwise_eq(&q, &d), "{fmt}: GGUF logits differ from the dequantised checkpoint's");
        // A directory holding only the GGUF loads too.
        std::fs::create_dir_all(t(&format!("{fmt}-dir"))).unwrap();
        std::fs::copy(&gguf, t(&format!("{fmt}-dir/model.gguf"))).unwrap();
        assert!(bitwise_eq(&q, &logits(&t(&format!("{fmt}-dir")), &t("dir.npy"))));

        // A ds4-style GGUF (ds4's names and `deepseek4.*` keys, no dsv4 metadata) loads with the
        // configuration inferred from those keys and the tensor shapes, to the same logits.
        let ds4 = t(&format!("{fmt}-ds4.gguf"));
        let mut w = GgufWriter::new();
        for (k, v) in g.metadata_all().iter().filter(|(k, _)| !k.starts_with("dsv4.")) {
            w.add_meta(k, v.clone());
        }
        for ti in g.tensors() {
            w.add_tensor(&ti.name, ti.dtype, &ti.shape, g.raw(&ti.name).unwrap().to_vec()).unwrap();
        }
        w.write(&ds4).unwrap();
        let gd = GgufFile::open(&ds4).unwrap();
        assert!(gd.metadata("dsv4.config_json").is_none());
        assert_eq!(gd.metadata("deepseek4.block_count").and_then(GgufValue::as_u64), Some(6));
        assert!(bitwise_eq(&q, &logits(&ds4, &t("ds4.npy"))), "{fmt}: ds4-style GGUF logits differ");

        // (b) within tolerance of the original f32 model.
        let (rel, agree) = compare(&q, &base, 512);
        eprintln!("{fmt}: relative L2 error of logits vs f32 {rel:.4}, argmax agreement {agree:.2}");
        assert!(rel < tol, "{fmt}: relative L2 error {rel} above {tol}");
        assert!(rel > 0.0);
    }
    let f32_size = std::fs::metadata(t("f32/model.safetensors")).unwrap().len();
    eprintln!("f32 safetensors: {f32_size} bytes");

    // Re-quantising a GGUF works (its config rides along).
    ok(&["quantize", "--in", s(&t("q4.gguf")), "--out", s(&t("again.gguf")), "--experts", "q4"]);
    // inspect prints the per-component table.
    let out = ok(&["inspect", "--model", s(&t("q2.gguf"))]);
    for w in ["routed experts", "attention", "embeddings/head", "total", "Q2_K"] {
        assert!(out.contains(w), "{out}");
    }

    // (c) errors: a truncated GGUF names a tensor; a GGUF without our config says so.
    let bytes = std::fs::read(t("q4.gguf")).unwrap();
    std::fs::write(t("trunc.gguf"), &bytes[..bytes.len() - 4096]).unwrap();
    let err = fails(&["logits", "--model", s(&t("trunc.gguf")), "--tokens", "1", "--out", s(&t("x.npy"))]);
    assert!(err.contains("truncated") && err.contains("tensor `"), "{err}");
    let mut w = GgufWriter::new();
    w.add_meta("general.architecture", GgufValue::String("deepseek4".into()));
    w.add_tensor("output_norm.weight", GgmlType::F32, &[4], vec![0; 16]).unwrap();
    w.write(&t("noconfig.gguf")).unwrap();
    let err = fails(&["logits", "--model", s(&t("noconfig.gguf")), "--tokens", "1", "--out", s(&t("x.npy"))]);
    assert!(err.contains("dsv4.config_json"), "{err}");
    // A GGUF whose tensor disagrees with its config names the tensor and both shapes.
    let g = GgufFile::open(&t("q4.gguf")).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in g.metadata_all() {
        w.add_meta(k, v.clone());
    }
    for ti in g.tensors() {
        let mut shape = ti.shape.clone();
        let mut data = g.raw(&ti.name).unwrap().to_vec();
        if ti.name == "blk.2.attn_q_a.weight" {
            shape[0] -= 1;
            data.truncate(data.len() / (shape[0] + 1) * shape[0]);
        }
        w.add_tensor(&ti.name, ti.dtype, &shape, data).unwrap();
    }
    w.write(&t("badshape.gguf")).unwrap();
    let err = fails(&["logits", "--model", s(&t("badshape.gguf")), "--tokens", "1", "--out", s(&t("x.npy"))]);
    assert!(err.contains("blk.2.attn_q_a.weight") && err.contains("[24, 256]") && err.contains("[23, 256]"), "{err}");
}
