//! A GGUF writer (version 3, little-endian), the counterpart of [`crate::gguf::GgufFile`].
//!
//! Metadata key/value pairs and tensors are collected, then [`GgufWriter::write`] lays out the
//! header (magic, version, counts), the metadata, the tensor infos (GGUF dims innermost-first,
//! i.e. the row-major shape reversed), padding to the alignment, and each tensor's data at an
//! offset that is a multiple of the alignment (default 32; another value is recorded under
//! `general.alignment`).

use crate::gguf::{GgmlType, GgufValue};
use std::collections::HashSet;
use std::io::Write;
use std::path::Path;

struct Pending {
    name: String,
    dtype: GgmlType,
    /// Row-major shape (`[.., rows, cols]`).
    shape: Vec<usize>,
    data: Vec<u8>,
}

/// Collects metadata and tensors, then writes one GGUF file.
pub struct GgufWriter {
    alignment: u64,
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<Pending>,
    names: HashSet<String>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

fn value_type(v: &GgufValue) -> u32 {
    match v {
        GgufValue::U8(_) => 0,
        GgufValue::I8(_) => 1,
        GgufValue::U16(_) => 2,
        GgufValue::I16(_) => 3,
        GgufValue::U32(_) => 4,
        GgufValue::I32(_) => 5,
        GgufValue::F32(_) => 6,
        GgufValue::Bool(_) => 7,
        GgufValue::String(_) => 8,
        GgufValue::Array(_) => 9,
        GgufValue::U64(_) => 10,
        GgufValue::I64(_) => 11,
        GgufValue::F64(_) => 12,
    }
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

/// The value's payload (without its type tag).
fn put_value(b: &mut Vec<u8>, v: &GgufValue) {
    match v {
        GgufValue::U8(x) => b.push(*x),
        GgufValue::I8(x) => b.push(*x as u8),
        GgufValue::U16(x) => b.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I16(x) => b.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U32(x) => b.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I32(x) => b.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F32(x) => b.extend_from_slice(&x.to_le_bytes()),
        GgufValue::Bool(x) => b.push(*x as u8),
        GgufValue::String(s) => put_str(b, s),
        GgufValue::U64(x) => b.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I64(x) => b.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F64(x) => b.extend_from_slice(&x.to_le_bytes()),
        GgufValue::Array(items) => {
            // An empty array is written as an empty array of u8.
            let et = items.first().map_or(0, value_type);
            b.extend_from_slice(&et.to_le_bytes());
            b.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for i in items {
                put_value(b, i);
            }
        }
    }
}

/// Whether every element of every (nested) array has its array's element type.
fn homogeneous(v: &GgufValue) -> bool {
    match v {
        GgufValue::Array(items) => {
            items.iter().all(|i| value_type(i) == value_type(&items[0])) && items.iter().all(homogeneous)
        }
        _ => true,
    }
}

impl GgufWriter {
    pub fn new() -> Self {
        GgufWriter { alignment: 32, metadata: Vec::new(), tensors: Vec::new(), names: HashSet::new() }
    }

    /// Data alignment (a power of two; 32 unless set). A value other than 32 is written as
    /// `general.alignment`.
    pub fn set_alignment(&mut self, alignment: u64) {
        assert!(alignment.is_power_of_two() && alignment >= 8, "alignment {alignment}");
        self.alignment = alignment;
    }

    /// Adds (or replaces) a metadata entry; arrays must be homogeneous.
    pub fn add_meta(&mut self, key: &str, value: GgufValue) {
        assert!(homogeneous(&value), "metadata `{key}`: arrays must hold one element type");
        assert_ne!(key, "general.alignment", "use set_alignment");
        match self.metadata.iter_mut().find(|(k, _)| k == key) {
            Some(e) => e.1 = value,
            None => self.metadata.push((key.to_string(), value)),
        }
    }

    /// Adds a tensor with the row-major `shape` (at most 4 dims) and `data` already encoded as
    /// `dtype` (whole blocks per row: the row length must be a multiple of the block size).
    pub fn add_tensor(&mut self, name: &str, dtype: GgmlType, shape: &[usize], data: Vec<u8>) -> Result<(), String> {
        if shape.len() > 4 {
            return Err(format!("tensor `{name}`: {} dims (at most 4)", shape.len()));
        }
        let cols = shape.last().copied().unwrap_or(1);
        if !cols.is_multiple_of(dtype.block_size()) {
            return Err(format!(
                "tensor `{name}`: row length {cols} is not a multiple of the {dtype} block size {}",
                dtype.block_size()
            ));
        }
        let numel: usize = shape.iter().product();
        let want = numel / dtype.block_size() * dtype.type_size();
        if data.len() != want {
            return Err(format!("tensor `{name}`: {} bytes of data, {dtype} {shape:?} needs {want}", data.len()));
        }
        if !self.names.insert(name.to_string()) {
            return Err(format!("tensor `{name}` added twice"));
        }
        self.tensors.push(Pending { name: name.to_string(), dtype, shape: shape.to_vec(), data });
        Ok(())
    }

    pub fn n_tensors(&self) -> usize {
        self.tensors.len()
    }

    /// The header bytes (through the padding before the data) and each tensor's data offset.
    fn header(&self) -> (Vec<u8>, Vec<u64>) {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        let align_kv =
            (self.alignment != 32).then(|| ("general.alignment".to_string(), GgufValue::U32(self.alignment as u32)));
        let kvs: Vec<&(String, GgufValue)> = align_kv.iter().chain(self.metadata.iter()).collect();
        b.extend_from_slice(&(kvs.len() as u64).to_le_bytes());
        for (k, v) in kvs {
            put_str(&mut b, k);
            b.extend_from_slice(&value_type(v).to_le_bytes());
            put_value(&mut b, v);
        }
        let mut offsets = Vec::with_capacity(self.tensors.len());
        let mut off = 0u64;
        for t in &self.tensors {
            put_str(&mut b, &t.name);
            b.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
            for &d in t.shape.iter().rev() {
                b.extend_from_slice(&(d as u64).to_le_bytes());
            }
            b.extend_from_slice(&t.dtype.id().to_le_bytes());
            b.extend_from_slice(&off.to_le_bytes());
            offsets.push(off);
            off = (off + t.data.len() as u64).div_ceil(self.alignment) * self.alignment;
        }
        b.resize(b.len().div_ceil(self.alignment as usize) * self.alignment as usize, 0);
        (b, offsets)
    }

    /// Writes the file (to `path.tmp`, then renamed, so a crash never leaves a half-written
    /// `path`). Returns its size in bytes.
    pub fn write(&self, path: &Path) -> std::io::Result<u64> {
        let (hdr, offsets) = self.header();
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = std::path::PathBuf::from(tmp);
        let mut f = std::io::BufWriter::with_capacity(1 << 22, std::fs::File::create(&tmp)?);
        f.write_all(&hdr)?;
        let mut pos = 0u64;
        for (t, &off) in self.tensors.iter().zip(&offsets) {
            f.write_all(&vec![0u8; (off - pos) as usize])?;
            f.write_all(&t.data)?;
            pos = off + t.data.len() as u64;
        }
        let file = f.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        let size = hdr.len() as u64 + pos;
        std::fs::rename(&tmp, path)?;
        Ok(size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;
    use crate::quant;

    #[test]
    fn round_trip_through_the_reader() {
        let dir = tempfile::tempdir().unwrap();
        for alignment in [32u64, 64] {
            let mut w = GgufWriter::new();
            if alignment != 32 {
                w.set_alignment(alignment);
            }
            let meta = [
                ("general.architecture", GgufValue::String("dsv4".into())),
                ("a.u8", GgufValue::U8(7)),
                ("a.i8", GgufValue::I8(-7)),
                ("a.u16", GgufValue::U16(65535)),
                ("a.i16", GgufValue::I16(-300)),
                ("a.u32", GgufValue::U32(1 << 31)),
                ("a.i32", GgufValue::I32(-5)),
                ("a.f32", GgufValue::F32(0.25)),
                ("a.bool", GgufValue::Bool(true)),
                ("a.u64", GgufValue::U64(u64::MAX)),
                ("a.i64", GgufValue::I64(i64::MIN)),
                ("a.f64", GgufValue::F64(-1e300)),
                ("a.utf8", GgufValue::String("héllo {\"json\": 1}".into())),
                ("a.arr", GgufValue::Array(vec![GgufValue::I32(1), GgufValue::I32(-2)])),
                ("a.strs", GgufValue::Array(vec![GgufValue::String("x".into()), GgufValue::String("".into())])),
                (
                    "a.nested",
                    GgufValue::Array(vec![
                        GgufValue::Array(vec![GgufValue::F32(1.0)]),
                        GgufValue::Array(vec![GgufValue::F32(2.0), GgufValue::F32(3.0)]),
                    ]),
                ),
                ("a.empty", GgufValue::Array(vec![])),
            ];
            for (k, v) in &meta {
                w.add_meta(k, v.clone());
            }
            let x: Vec<f32> = (0..2 * 3 * 256).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
            let f32b: Vec<u8> = x[..5 * 32].iter().flat_map(|v| v.to_le_bytes()).collect();
            w.add_tensor("plain", GgmlType::F32, &[5, 32], f32b).unwrap();
            let f16b: Vec<u8> = x[..7].iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect();
            w.add_tensor("odd.f16", GgmlType::F16, &[7], f16b).unwrap();
            w.add_tensor("q8", GgmlType::Q8_0, &[6, 256], quant::quantize_q8_0(&x)).unwrap();
            w.add_tensor("q4k", GgmlType::Q4_K, &[2, 3, 256], quant::quantize_q4_k(&x)).unwrap();
            w.add_tensor("q2k", GgmlType::Q2_K, &[3, 512], quant::quantize_q2_k(&x)).unwrap();
            w.add_tensor("iq2", GgmlType::IQ2_XXS, &[6, 256], quant::quantize_iq2_xxs(&x)).unwrap();
            let ib: Vec<u8> = [3i32, -1, 9].iter().flat_map(|v| v.to_le_bytes()).collect();
            w.add_tensor("ids", GgmlType::I32, &[3, 1], ib).unwrap();
            assert!(w.add_tensor("ids", GgmlType::I32, &[1], vec![0; 4]).unwrap_err().contains("twice"));
            assert!(w.add_tensor("bad", GgmlType::Q4_K, &[2, 64], vec![0; 72]).unwrap_err().contains("block size"));
            assert!(w.add_tensor("bad", GgmlType::F32, &[2], vec![0; 4]).unwrap_err().contains("needs 8"));

            let p = dir.path().join(format!("t{alignment}.gguf"));
            let size = w.write(&p).unwrap();
            assert_eq!(size, std::fs::metadata(&p).unwrap().len());
            let f = GgufFile::open(&p).unwrap();
            assert_eq!((f.version(), f.alignment()), (3, alignment));
            for (k, v) in &meta {
                assert_eq!(f.metadata(k), Some(v), "{k}");
            }
            assert_eq!(f.tensors().len(), 7);
            assert!(f.tensors().iter().all(|t| t.offset % alignment == 0));
            assert_eq!(f.f32("plain").unwrap(), x[..160]);
            assert_eq!(f.info("plain").unwrap().dims, [32, 5]);
            let h: Vec<f32> = x[..7].iter().map(|v| half::f16::from_f32(*v).to_f32()).collect();
            assert_eq!(f.f32("odd.f16").unwrap(), h);
            for (name, ty, shape) in [
                ("q8", GgmlType::Q8_0, vec![6, 256]),
                ("q4k", GgmlType::Q4_K, vec![2, 3, 256]),
                ("q2k", GgmlType::Q2_K, vec![3, 512]),
                ("iq2", GgmlType::IQ2_XXS, vec![6, 256]),
            ] {
                let t = f.info(name).unwrap();
                assert_eq!((t.dtype, &t.shape), (ty, &shape));
                let got = f.f32(name).unwrap();
                let mut want = vec![0f32; x.len()];
                match ty {
                    GgmlType::Q8_0 => quant::dequant_q8_0(f.raw(name).unwrap(), &mut want),
                    GgmlType::Q4_K => quant::dequant_q4_k(f.raw(name).unwrap(), &mut want),
                    GgmlType::Q2_K => quant::dequant_q2_k(f.raw(name).unwrap(), &mut want),
                    _ => quant::dequant_iq2_xxs(f.raw(name).unwrap(), &mut want),
                }
                assert_eq!(got, want, "{name}");
                let err = got.iter().zip(&x).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(err < 1.5, "{name}: max error {err}");
            }
            assert_eq!(f.i32("ids").unwrap(), [3, -1, 9]);
        }
    }
}
