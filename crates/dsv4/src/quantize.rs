//! `dsv4 quantize`: any checkpoint the loader reads → a GGUF with antirez/ds4's tensor names and
//! type policy, plus the model configuration as metadata: `dsv4.config_json` and ds4's
//! `deepseek4.*` keys.

use anyhow::{bail, Context, Result};
use dsv4_model::gguf::{official_expert_to_gguf, official_to_gguf, GgmlType, GgufValue, CONFIG_KEY};
use dsv4_model::gguf_config::ds4_metadata;
use dsv4_model::gguf_write::GgufWriter;
use dsv4_model::{load_weights_from, quant, Checkpoint, HostTensor, LoadError};
use rayon::prelude::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Routed-expert formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ExpertQuant {
    /// Q4_K gate/up/down (4.5 bits per weight).
    Q4,
    /// IQ2_XXS gate/up (2.06 bits per weight) and Q2_K down (2.625), as ds4 does.
    Q2,
}

#[derive(clap::Args)]
pub struct QuantizeArgs {
    /// Checkpoint to read (a directory with config.json + safetensors, HF or official layout, or
    /// a GGUF written by dsv4 quantize).
    #[arg(long = "in")]
    input: PathBuf,
    /// The GGUF to write.
    #[arg(long)]
    out: PathBuf,
    /// Routed-expert format: q4 = Q4_K; q2 = IQ2_XXS gate/up and Q2_K down (ds4's q2).
    /// Attention, shared experts and the head are Q8_0; embedding, mHC fn, compressors, indexers
    /// and routers F16; norms, mHC base/scale, sinks, biases and position biases F32; hash tables
    /// I32. Tensors whose rows are not a multiple of the format's block size fall back to Q8_0 or
    /// F16 (listed on output).
    #[arg(long, value_enum)]
    experts: ExpertQuant,
}

/// The type ds4's policy gives an official tensor (before any fallback).
fn policy(official: &str, shape: &[usize], experts: ExpertQuant) -> GgmlType {
    let n = official.strip_prefix("model.").unwrap_or(official);
    if n.contains(".ffn.experts.") {
        // ds4: q4 → Q4_K everywhere; q2 → IQ2_XXS gate/up (w1/w3) + Q2_K down (w2).
        return match experts {
            ExpertQuant::Q4 => GgmlType::Q4_K,
            ExpertQuant::Q2 if n.ends_with(".w2.weight") => GgmlType::Q2_K,
            ExpertQuant::Q2 => GgmlType::IQ2_XXS,
        };
    }
    if shape.len() < 2 || n.ends_with(".ape") {
        // norms, mHC base/scale, sinks, router bias, compressor position biases
        return GgmlType::F32;
    }
    if n == "head.weight" || n.contains(".ffn.shared_experts.") {
        return GgmlType::Q8_0;
    }
    if n.contains(".attn.compressor.") || n.contains(".attn.indexer.") {
        return GgmlType::F16;
    }
    if n.contains(".attn.w") {
        return GgmlType::Q8_0;
    }
    // embedding, mHC fn, router
    GgmlType::F16
}

/// `want` if the rows fit its blocks, else Q8_0 (32-blocks), else F16.
fn fit(want: GgmlType, cols: usize) -> GgmlType {
    [want, GgmlType::Q8_0, GgmlType::F16]
        .into_iter()
        .find(|t| cols.is_multiple_of(t.block_size()))
        .unwrap_or(GgmlType::F32)
}

/// Encodes `x` (whole rows of `cols`) as `t`, in parallel over rows.
fn encode(t: GgmlType, x: &[f32], cols: usize) -> Vec<u8> {
    match t {
        GgmlType::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        GgmlType::F16 => x.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
        GgmlType::Q8_0 | GgmlType::Q4_K | GgmlType::Q2_K | GgmlType::IQ2_XXS => {
            let rows_per_task = (65536 / cols.max(1)).max(1);
            let parts: Vec<Vec<u8>> = x
                .par_chunks(rows_per_task * cols)
                .map(|c| match t {
                    GgmlType::Q8_0 => quant::quantize_q8_0(c),
                    GgmlType::Q4_K => quant::quantize_q4_k(c),
                    GgmlType::Q2_K => quant::quantize_q2_k(c),
                    _ => quant::quantize_iq2_xxs(c),
                })
                .collect();
            parts.concat()
        }
        other => unreachable!("no encoder for {other}"),
    }
}

/// One stacked routed-expert tensor being filled expert by expert.
struct Stack {
    dtype: GgmlType,
    shape: [usize; 2],
    parts: Vec<Option<Vec<u8>>>,
}

struct Quantizer {
    experts: ExpertQuant,
    n_experts: usize,
    w: GgufWriter,
    stacks: BTreeMap<String, Stack>,
    /// `(gguf name, wanted, written)` for every fallback.
    fallbacks: Vec<(String, GgmlType, GgmlType)>,
    /// Tensors and bytes per written type.
    by_type: BTreeMap<String, (usize, u64)>,
}

impl Quantizer {
    fn count(&mut self, t: GgmlType, bytes: usize) {
        let e = self.by_type.entry(t.name()).or_default();
        e.0 += 1;
        e.1 += bytes as u64;
    }

    fn add(&mut self, t: HostTensor) -> Result<(), LoadError> {
        let bad = |msg: String| LoadError::Value { name: t.name.clone(), msg };
        let cols = t.shape.last().copied().unwrap_or(1);
        let want = policy(&t.name, &t.shape, self.experts);
        let dtype = fit(want, cols);
        if let Some((gname, e)) = official_expert_to_gguf(&t.name) {
            let shape = [t.shape[0], t.shape[1]];
            let n = self.n_experts;
            let st = self.stacks.entry(gname.clone()).or_insert_with(|| Stack { dtype, shape, parts: vec![None; n] });
            if st.shape != shape || e >= n || st.parts[e].is_some() {
                return Err(bad(format!("expert {e} of {gname} with shape {shape:?} does not fit the stack")));
            }
            st.parts[e] = Some(encode(dtype, &t.data, cols));
            if st.parts.iter().all(Option::is_some) {
                let st = self.stacks.remove(&gname).unwrap();
                let data: Vec<u8> = st.parts.into_iter().flatten().flatten().collect();
                if st.dtype != want {
                    self.fallbacks.push((gname.clone(), want, st.dtype));
                }
                self.count(st.dtype, data.len());
                self.w.add_tensor(&gname, st.dtype, &[n, shape[0], shape[1]], data).map_err(bad)?;
            }
            return Ok(());
        }
        let gname = official_to_gguf(&t.name).ok_or_else(|| bad("no ds4 GGUF name for this tensor".into()))?;
        if dtype != want {
            self.fallbacks.push((gname.clone(), want, dtype));
        }
        let data = encode(dtype, &t.data, cols);
        self.count(dtype, data.len());
        self.w.add_tensor(&gname, dtype, &t.shape, data).map_err(bad)
    }
}

/// The config.json text to embed: the checkpoint's own (keeps every key), or the GGUF's.
fn config_text(input: &Path, ck: &Checkpoint, cfg: &dsv4_model::Config) -> Result<String> {
    if let Checkpoint::Gguf(g) = ck {
        if let Some(s) = g.metadata(CONFIG_KEY).and_then(|v| v.as_str()) {
            return Ok(s.to_string());
        }
    }
    let p = input.join("config.json");
    if p.is_file() {
        return std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()));
    }
    Ok(serde_json::to_string_pretty(&cfg.to_hf_json())?)
}

pub fn run(a: QuantizeArgs) -> Result<()> {
    let t0 = std::time::Instant::now();
    let (cfg, ck) = Checkpoint::open(&a.input).with_context(|| format!("opening {}", a.input.display()))?;
    if a.out.exists() && a.out.is_dir() {
        bail!("--out {} is a directory; give a .gguf file path", a.out.display());
    }
    let mut q = Quantizer {
        experts: a.experts,
        n_experts: cfg.n_routed_experts,
        w: GgufWriter::new(),
        stacks: BTreeMap::new(),
        fallbacks: Vec::new(),
        by_type: BTreeMap::new(),
    };
    let (name, note) = match a.experts {
        ExpertQuant::Q4 => ("q4", "routed experts Q4_K"),
        ExpertQuant::Q2 => ("q2", "routed experts IQ2_XXS gate/up, Q2_K down"),
    };
    q.w.add_meta("general.architecture", GgufValue::String("deepseek4".into()));
    q.w.add_meta("general.name", GgufValue::String(format!("DeepSeek V4 ({name})")));
    q.w.add_meta("general.quantized_by", GgufValue::String(format!("dsv4 quantize {}", env!("CARGO_PKG_VERSION"))));
    q.w.add_meta("dsv4.quantize.experts", GgufValue::String(name.into()));
    q.w.add_meta("dsv4.quantize.note", GgufValue::String(note.into()));
    q.w.add_meta(CONFIG_KEY, GgufValue::String(config_text(&a.input, &ck, &cfg)?));
    // ds4's own keys too, which ds4 requires and which describe the model without our JSON.
    for (k, v) in ds4_metadata(&cfg) {
        q.w.add_meta(&k, v);
    }
    let (weights, _stats) = load_weights_from(ck.source(), &cfg, true, |t| q.add(t))
        .with_context(|| format!("reading {}", a.input.display()))?;
    // Hash-routing tables are not uploaded tensors: write them from the loaded weights.
    for (l, layer) in weights.layers.iter().enumerate() {
        if let Some(ids) = &layer.ffn.tid2eid {
            let name = format!("blk.{l}.ffn_gate_tid2eid.weight");
            let bytes: Vec<u8> = ids.iter().flat_map(|&x| (x as i32).to_le_bytes()).collect();
            q.count(GgmlType::I32, bytes.len());
            q.w.add_tensor(&name, GgmlType::I32, &[cfg.vocab_size, cfg.n_experts_per_tok], bytes)
                .map_err(anyhow::Error::msg)?;
        }
    }
    if !q.stacks.is_empty() {
        bail!("incomplete routed-expert stacks: {:?}", q.stacks.keys().collect::<Vec<_>>());
    }
    let size = q.w.write(&a.out).with_context(|| format!("writing {}", a.out.display()))?;
    for (n, want, got) in &q.fallbacks {
        eprintln!("fallback: {n}: {want} -> {got} (row length not a multiple of the {want} block size)");
    }
    if !q.fallbacks.is_empty() {
        eprintln!("{} tensors fell back to another type", q.fallbacks.len());
    }
    for (t, (n, b)) in &q.by_type {
        eprintln!("  {t:<8} {n:>6} tensors {b:>14} bytes");
    }
    eprintln!(
        "wrote {} ({} tensors, {size} bytes, {:.1} MiB) in {:.1}s",
        a.out.display(),
        q.w.n_tensors(),
        size as f64 / (1 << 20) as f64,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

#[derive(clap::Args)]
pub struct InspectArgs {
    /// Checkpoint (directory with config.json + safetensors, or a GGUF).
    #[arg(long)]
    model: PathBuf,
}

/// `dsv4 inspect`: the checkpoint's format, tensor types, and bytes per component (read through
/// the loader, so every tensor is checked and dequantised once).
pub fn inspect(a: InspectArgs) -> Result<()> {
    let (cfg, ck) = Checkpoint::open(&a.model).with_context(|| format!("opening {}", a.model.display()))?;
    println!("model: {}", a.model.display());
    println!(
        "config: {} layers, hidden {}, vocab {}, {} routed experts (top {}), moe_inter {}",
        cfg.n_layers(),
        cfg.hidden,
        cfg.vocab_size,
        cfg.n_routed_experts,
        cfg.n_experts_per_tok,
        cfg.moe_inter
    );
    match &ck {
        Checkpoint::Gguf(g) => {
            println!(
                "format: GGUF v{} ({} tensors, {} metadata keys)",
                g.version(),
                g.tensors().len(),
                g.metadata_all().len()
            );
            for (k, v) in g.metadata_all() {
                if k != CONFIG_KEY {
                    println!("  {k} = {v:?}");
                }
            }
            let mut by: BTreeMap<String, (usize, u64)> = BTreeMap::new();
            for t in g.tensors() {
                let e = by.entry(t.dtype.name()).or_default();
                e.0 += 1;
                e.1 += t.n_bytes;
            }
            for (t, (n, b)) in by {
                println!("  {t:<8} {n:>6} tensors {b:>14} bytes");
            }
        }
        Checkpoint::Safetensors(s) => println!("format: safetensors ({} tensors)", s.names().count()),
    }
    let (_, stats) = load_weights_from(ck.source(), &cfg, true, |_| Ok(()))?;
    print!("{}", stats.table());
    Ok(())
}
