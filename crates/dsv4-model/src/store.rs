//! Memory-mapped safetensors checkpoints: one file, a sharded set with
//! `model.safetensors.index.json`, or every `*.safetensors` in a directory.
//!
//! Headers are parsed here (not by the `safetensors` crate) so that the FP8/UE8M0/FP4 dtypes of
//! the official checkpoints are read as they are, and so every error names the tensor.

use memmap2::Mmap;
use serde_json::Value;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use crate::quant::{e4m3_to_f32, e8m0_to_f32};

/// Element types found in DeepSeek V4 checkpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F64,
    F32,
    F16,
    BF16,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
    F8E4M3,
    F8E5M2,
    F8E8M0,
}

impl DType {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "F64" => DType::F64,
            "F32" => DType::F32,
            "F16" => DType::F16,
            "BF16" => DType::BF16,
            "I64" => DType::I64,
            "I32" => DType::I32,
            "I16" => DType::I16,
            "I8" => DType::I8,
            "U8" => DType::U8,
            "BOOL" => DType::Bool,
            "F8_E4M3" => DType::F8E4M3,
            "F8_E5M2" => DType::F8E5M2,
            "F8_E8M0" => DType::F8E8M0,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F64 => "F64",
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I64 => "I64",
            DType::I32 => "I32",
            DType::I16 => "I16",
            DType::I8 => "I8",
            DType::U8 => "U8",
            DType::Bool => "BOOL",
            DType::F8E4M3 => "F8_E4M3",
            DType::F8E5M2 => "F8_E5M2",
            DType::F8E8M0 => "F8_E8M0",
        }
    }
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            _ => 1,
        }
    }
    /// Whether [`TensorStore::f32`] can read this type as plain values (no scales needed).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F64 | DType::F32 | DType::F16 | DType::BF16 | DType::F8E4M3 | DType::F8E8M0)
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A checkpoint problem; every variant names the file or tensor involved.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: bad safetensors header: {msg}")]
    Header { path: String, msg: String },
    #[error("{path}: tensor `{tensor}` needs bytes {start}..{end} but the file has only {file_len} bytes of data (truncated file?)")]
    Truncated { path: String, tensor: String, start: u64, end: u64, file_len: u64 },
    #[error("missing tensor `{name}` (looked for: {tried})")]
    Missing { name: String, tried: String },
    #[error("tensor `{name}`: expected shape {expected:?}, found {found:?}")]
    Shape { name: String, expected: Vec<usize>, found: Vec<usize> },
    #[error("tensor `{name}`: expected dtype {expected}, found {found}")]
    DType { name: String, expected: String, found: String },
    #[error("tensor `{name}`: {msg}")]
    Value { name: String, msg: String },
    /// A checkpoint-level problem other than a safetensors header (GGUF header, missing config).
    #[error("{path}: {msg}")]
    Format { path: String, msg: String },
    #[error("no safetensors files in {0}")]
    Empty(String),
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
}

/// One tensor's header entry.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub dtype: DType,
    pub shape: Vec<usize>,
    file: usize,
    start: usize,
    end: usize,
}

impl TensorInfo {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

struct Shard {
    path: PathBuf,
    map: Mmap,
    data_start: usize,
}

/// All tensors of a checkpoint, memory mapped; nothing is read until asked for.
pub struct TensorStore {
    shards: Vec<Shard>,
    tensors: BTreeMap<String, TensorInfo>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> LoadError + '_ {
    move |source| LoadError::Io { path: path.display().to_string(), source }
}

impl TensorStore {
    /// Opens `dir` (or a single `.safetensors` file).
    pub fn open(dir: &Path) -> Result<Self, LoadError> {
        let files: Vec<PathBuf> = if dir.is_file() {
            vec![dir.to_path_buf()]
        } else if dir.join("model.safetensors.index.json").exists() {
            let ip = dir.join("model.safetensors.index.json");
            let text = std::fs::read_to_string(&ip).map_err(io(&ip))?;
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| LoadError::Header { path: ip.display().to_string(), msg: e.to_string() })?;
            let wm = v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| LoadError::Header {
                path: ip.display().to_string(),
                msg: "no `weight_map` object".into(),
            })?;
            let mut names: Vec<String> = wm.values().filter_map(|s| s.as_str().map(str::to_string)).collect();
            names.sort();
            names.dedup();
            for n in &names {
                if n.contains('/') || n.contains("..") {
                    return Err(LoadError::Header {
                        path: ip.display().to_string(),
                        msg: format!("shard name `{n}` leaves the directory"),
                    });
                }
            }
            names.into_iter().map(|n| dir.join(n)).collect()
        } else {
            let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(io(dir))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
                .collect();
            v.sort();
            v
        };
        if files.is_empty() {
            return Err(LoadError::Empty(dir.display().to_string()));
        }
        let mut shards = Vec::new();
        let mut tensors = BTreeMap::new();
        for (fi, path) in files.into_iter().enumerate() {
            let file = File::open(&path).map_err(io(&path))?;
            // SAFETY: the checkpoint is opened read-only; like every mmap-based loader we assume the
            // file is not truncated or rewritten by another process while the engine runs.
            let map = unsafe { Mmap::map(&file) }.map_err(io(&path))?;
            let pstr = path.display().to_string();
            let hdr = |msg: String| LoadError::Header { path: pstr.clone(), msg };
            if map.len() < 8 {
                return Err(hdr(format!("file is {} bytes, shorter than the 8-byte header length", map.len())));
            }
            let n = u64::from_le_bytes(map[..8].try_into().unwrap()) as usize;
            if n > map.len() - 8 {
                return Err(hdr(format!("header length {n} exceeds the file ({} bytes): truncated file?", map.len())));
            }
            let v: Value = serde_json::from_slice(&map[8..8 + n]).map_err(|e| hdr(e.to_string()))?;
            let obj = v.as_object().ok_or_else(|| hdr("header is not an object".into()))?;
            let data_start = 8 + n;
            let data_len = (map.len() - data_start) as u64;
            for (name, t) in obj {
                if name == "__metadata__" {
                    continue;
                }
                let bad = |m: &str| hdr(format!("tensor `{name}`: {m}"));
                let dts = t.get("dtype").and_then(|d| d.as_str()).ok_or_else(|| bad("no dtype"))?;
                let dtype = DType::parse(dts).ok_or_else(|| bad(&format!("unsupported dtype {dts}")))?;
                let shape: Vec<usize> = t
                    .get("shape")
                    .and_then(|s| s.as_array())
                    .ok_or_else(|| bad("no shape"))?
                    .iter()
                    .map(|d| d.as_u64().map(|x| x as usize))
                    .collect::<Option<_>>()
                    .ok_or_else(|| bad("bad shape"))?;
                let off = t.get("data_offsets").and_then(|s| s.as_array()).ok_or_else(|| bad("no data_offsets"))?;
                let (s, e) = match (off.first().and_then(|x| x.as_u64()), off.get(1).and_then(|x| x.as_u64())) {
                    (Some(s), Some(e)) if s <= e => (s, e),
                    _ => return Err(bad("bad data_offsets")),
                };
                if e > data_len {
                    return Err(LoadError::Truncated {
                        path: pstr.clone(),
                        tensor: name.clone(),
                        start: s,
                        end: e,
                        file_len: data_len,
                    });
                }
                let numel: usize = shape.iter().product();
                if (e - s) as usize != numel * dtype.size() {
                    return Err(bad(&format!("{} bytes for {numel} elements of {dtype}", e - s)));
                }
                let info = TensorInfo { dtype, shape, file: fi, start: s as usize, end: e as usize };
                if tensors.insert(name.clone(), info).is_some() {
                    return Err(bad("appears in two shards"));
                }
            }
            shards.push(Shard { path, map, data_start });
        }
        Ok(TensorStore { shards, tensors })
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Total bytes of tensor data (for progress reporting).
    pub fn total_bytes(&self) -> u64 {
        self.tensors.values().map(|t| (t.end - t.start) as u64).sum()
    }

    fn get(&self, name: &str) -> Result<&TensorInfo, LoadError> {
        self.tensors.get(name).ok_or_else(|| LoadError::Missing { name: name.into(), tried: name.into() })
    }

    /// The raw little-endian bytes of a tensor.
    pub fn raw(&self, name: &str) -> Result<&[u8], LoadError> {
        let t = self.get(name)?;
        let sh = &self.shards[t.file];
        Ok(&sh.map[sh.data_start + t.start..sh.data_start + t.end])
    }

    /// Path of the shard holding a tensor (for messages).
    pub fn path_of(&self, name: &str) -> Option<&Path> {
        self.tensors.get(name).map(|t| self.shards[t.file].path.as_path())
    }

    /// Reads a float tensor as f32 (F64/F32/F16/BF16/F8_E4M3/F8_E8M0, without scales).
    pub fn f32(&self, name: &str) -> Result<Vec<f32>, LoadError> {
        let t = self.get(name)?;
        self.f32_range(name, 0, t.numel())
    }

    /// Reads elements `[start, start+len)` of the flattened tensor as f32: slices experts out of
    /// HF's fused `[E, 2I, d]` tensors without reading the rest.
    pub fn f32_range(&self, name: &str, start: usize, len: usize) -> Result<Vec<f32>, LoadError> {
        let t = self.get(name)?;
        if start + len > t.numel() {
            return Err(LoadError::Value {
                name: name.into(),
                msg: format!("range {start}+{len} beyond {} elements", t.numel()),
            });
        }
        let sz = t.dtype.size();
        let b = &self.raw(name)?[start * sz..(start + len) * sz];
        let out = match t.dtype {
            DType::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
            DType::F64 => b.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap()) as f32).collect(),
            DType::F16 => {
                b.chunks_exact(2).map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()).collect()
            }
            DType::BF16 => {
                b.chunks_exact(2).map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()).collect()
            }
            DType::F8E4M3 => b.iter().map(|&x| e4m3_to_f32(x)).collect(),
            DType::F8E8M0 => b.iter().map(|&x| e8m0_to_f32(x)).collect(),
            other => {
                return Err(LoadError::DType {
                    name: name.into(),
                    expected: "a float type".into(),
                    found: other.name().into(),
                })
            }
        };
        Ok(out)
    }

    /// Reads an integer tensor (I64/I32/I16/I8/U8) as i64.
    pub fn i64(&self, name: &str) -> Result<Vec<i64>, LoadError> {
        let t = self.get(name)?;
        let b = self.raw(name)?;
        Ok(match t.dtype {
            DType::I64 => b.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect(),
            DType::I32 => b.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64).collect(),
            DType::I16 => b.chunks_exact(2).map(|c| i16::from_le_bytes([c[0], c[1]]) as i64).collect(),
            DType::I8 => b.iter().map(|&x| x as i8 as i64).collect(),
            DType::U8 => b.iter().map(|&x| x as i64).collect(),
            other => {
                return Err(LoadError::DType {
                    name: name.into(),
                    expected: "an integer type".into(),
                    found: other.name().into(),
                })
            }
        })
    }
}

/// Writes a safetensors file (used by `init-tiny` and by tests that build bad checkpoints).
/// Tensors are `(name, dtype, shape, little-endian bytes)`, written in the given order.
pub fn write_safetensors(path: &Path, tensors: &[(String, DType, Vec<usize>, Vec<u8>)]) -> std::io::Result<()> {
    use std::io::Write;
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut off = 0usize;
    for (name, dt, shape, bytes) in tensors {
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dt.name(), "shape": shape, "data_offsets": [off, off + bytes.len()]}),
        );
        off += bytes.len();
    }
    let mut h = serde_json::to_vec(&Value::Object(header))?;
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut f = std::io::BufWriter::new(File::create(path)?);
    f.write_all(&(h.len() as u64).to_le_bytes())?;
    f.write_all(&h)?;
    for (_, _, _, bytes) in tensors {
        f.write_all(bytes)?;
    }
    f.into_inner().map_err(|e| e.into_error())?.sync_all()
}

/// f32 values as little-endian bytes.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
