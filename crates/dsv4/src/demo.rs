//! The built-in demo model: a random tiny checkpoint (every layer type) with the real DeepSeek V4
//! tokenizer, so everything runs without downloading a 160 GB checkpoint.

use anyhow::{Context, Result};
use dsv4_model::store::write_safetensors;
use dsv4_model::synth::{random_checkpoint, random_dspark, tiny_config, SynthDType, SynthDspark};
use std::path::{Path, PathBuf};

/// Vocabulary of the demo model: the real tokenizer's, so text round-trips.
pub const DEMO_VOCAB: usize = 129280;

/// Writes config.json, model.safetensors and tokenizer.json into `out`.
pub fn init_tiny(out: &Path, seed: u64) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let mut cfg = tiny_config(DEMO_VOCAB);
    // Room for chat-length prompts: a wider window and the Flash ratios.
    cfg.window = 64;
    for l in cfg.layers.iter_mut() {
        if l.ratio == 8 {
            l.ratio = 128;
        }
    }
    cfg.index_topk = 16;
    // A random DSpark drafter (`mtp.0..2.*`, `dspark_*` keys) rides along, so `--dspark` runs
    // without downloads; it shares the target's embedding and LM head.
    let ds = SynthDspark::for_config(&cfg);
    let mut json = cfg.to_hf_json();
    for (k, v) in ds.json_keys() {
        json[k] = v;
    }
    std::fs::write(out.join("config.json"), serde_json::to_string_pretty(&json)?)?;
    let mut tensors = random_checkpoint(&cfg, seed, SynthDType::BF16);
    tensors.extend(random_dspark(&cfg, &ds, seed, SynthDType::BF16));
    write_safetensors(&out.join("model.safetensors"), &tensors)?;
    std::fs::write(out.join("tokenizer.json"), dsv4_tokenizer::Tokenizer::embedded_json()?)?;
    Ok(())
}

/// The demo checkpoint, created on first use under the user's cache directory.
pub fn demo_model_dir() -> Result<PathBuf> {
    let base = std::env::var_os("DSV4_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|p| PathBuf::from(p).join("dsv4")))
        .or_else(|| std::env::var_os("HOME").map(|p| PathBuf::from(p).join(".cache/dsv4")))
        .unwrap_or_else(|| PathBuf::from(".dsv4-cache"));
    let dir = base.join(format!("demo-v{}-dspark", env!("CARGO_PKG_VERSION")));
    if !dir.join("model.safetensors").exists() {
        tracing::info!("no --model given: creating the built-in demo model (random weights) in {}", dir.display());
        let tmp = base.join(format!("demo-tmp-{}", std::process::id()));
        init_tiny(&tmp, 0)?;
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::rename(&tmp, &dir).with_context(|| format!("moving demo model into {}", dir.display()))?;
    }
    tracing::warn!("using the built-in DEMO model (random weights, output is gibberish): {}", dir.display());
    Ok(dir)
}
