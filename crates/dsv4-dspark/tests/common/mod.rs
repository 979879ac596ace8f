//! Shared helpers of the golden tests: fixture access (float64 kept as f64) and error metrics.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use dsv4_dspark::Drafter;
use dsv4_model::{DType, TensorStore};

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A golden safetensors file, read at full precision.
pub struct Golden {
    pub store: TensorStore,
}

impl Golden {
    pub fn open(file: &str) -> Self {
        Golden { store: TensorStore::open(&fixtures().join(file)).unwrap_or_else(|e| panic!("{file}: {e}")) }
    }
    pub fn shape(&self, name: &str) -> Vec<usize> {
        self.store.info(name).unwrap_or_else(|| panic!("golden tensor {name} missing")).shape.clone()
    }
    pub fn f64(&self, name: &str) -> Vec<f64> {
        let info = self.store.info(name).unwrap_or_else(|| panic!("golden tensor {name} missing"));
        assert_eq!(info.dtype, DType::F64, "{name}");
        self.store.raw(name).unwrap().chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect()
    }
    pub fn f32(&self, name: &str) -> Vec<f32> {
        self.f64(name).into_iter().map(|x| x as f32).collect()
    }
    pub fn i64(&self, name: &str) -> Vec<i64> {
        self.store.i64(name).unwrap()
    }
    pub fn u32(&self, name: &str) -> Vec<u32> {
        self.i64(name).into_iter().map(|x| x as u32).collect()
    }
}

/// A checkpoint directory: the official config plus `weights.safetensors` (target + `mtp.*`).
pub fn model_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fixtures().join("config_official.json"), dir.path().join("config.json")).unwrap();
    let w = dir.path().join("weights.safetensors");
    if std::os::unix::fs::symlink(fixtures().join("weights.safetensors"), &w).is_err() {
        std::fs::copy(fixtures().join("weights.safetensors"), &w).unwrap();
    }
    dir
}

pub fn drafter() -> Drafter {
    let dir = model_dir();
    Drafter::load_dir(dir.path()).unwrap()
}

/// `max |a − b| / max |b|` (relative to the golden tensor's scale).
pub fn rel(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let num = a.iter().zip(b).map(|(x, y)| (*x as f64 - y).abs()).fold(0.0, f64::max);
    let den = b.iter().map(|y| y.abs()).fold(0.0, f64::max).max(1e-30);
    num / den
}

pub fn rel64(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let num = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    let den = b.iter().map(|y| y.abs()).fold(0.0, f64::max).max(1e-30);
    num / den
}

pub fn maxabs(a: &[f32], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (*x as f64 - y).abs()).fold(0.0, f64::max)
}

/// Running maximum of an error metric per component, printed as a table.
#[derive(Default)]
pub struct Errors(pub Vec<(String, f64, f64)>);

impl Errors {
    /// Records `err` for `name`, checked against `tol`.
    pub fn add(&mut self, name: &str, err: f64, tol: f64) {
        match self.0.iter_mut().find(|e| e.0 == name) {
            Some(e) => e.1 = e.1.max(err),
            None => self.0.push((name.to_string(), err, tol)),
        }
    }
    pub fn check(&self, title: &str) {
        eprintln!("{title}:");
        for (n, e, t) in &self.0 {
            eprintln!("  {n:<28} {e:10.3e}  (tol {t:.0e})");
        }
        for (n, e, t) in &self.0 {
            assert!(e.is_finite() && e <= t, "{title}: {n}: error {e:e} > tolerance {t:e}");
        }
    }
}
