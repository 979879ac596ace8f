//! Shared helpers for the backend's integration tests.
#![allow(dead_code)]

use dsv4_backend::cpu::CpuBackend;
use dsv4_backend::Model;
use dsv4_model::store::write_safetensors;
use dsv4_model::synth::{random_checkpoint, SynthDType};
use dsv4_model::Config;
use std::path::{Path, PathBuf};

/// Writes a random checkpoint for `cfg` into `dir`.
pub fn write_random(dir: &Path, cfg: &Config, seed: u64) {
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&cfg.to_hf_json()).unwrap()).unwrap();
    write_safetensors(&dir.join("model.safetensors"), &random_checkpoint(cfg, seed, SynthDType::F32)).unwrap();
}

pub fn load(dir: &Path, max_seqs: usize) -> Model<CpuBackend> {
    Model::load(CpuBackend, dir, max_seqs, false).unwrap()
}

/// Max |a − b| / max |b|.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
    let diff = a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((*x as f64 - *y as f64).abs()));
    diff / scale
}

/// The HF fixtures: `DSV4_FIXTURES`, else next to the run-time manifest dir (nextest's
/// `--workspace-remap` sets it on another machine), else where this test was built.
pub fn fixtures_dir() -> PathBuf {
    if let Ok(d) = std::env::var("DSV4_FIXTURES") {
        return d.into();
    }
    if let Ok(d) = std::env::var("CARGO_MANIFEST_DIR") {
        let p = Path::new(&d).join("../../tests/fixtures/hf");
        if p.exists() {
            return p;
        }
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf")
}

/// The bf16 CUDA backend in exact mode (f32 activations into every bf16 product), or `None`
/// with a clear message where no driver or device is present.
#[cfg(feature = "cuda")]
pub fn gpu() -> Option<dsv4_backend::cuda::CudaBackend> {
    dsv4_backend::cuda::CudaBackend::exact_or_skip(false)
}

/// Deterministic pseudo-random token ids.
pub fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}
