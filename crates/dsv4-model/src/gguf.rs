//! Memory-mapped GGUF files (versions 2 and 3, little-endian), as written by llama.cpp's
//! `gguf-py` and by antirez/ds4's `deepseek4-quantize`.
//!
//! Layout: magic `GGUF`, `u32` version, `u64` tensor count, `u64` metadata count, the metadata
//! key/value pairs, the tensor infos (name, `u32` n_dims, `u64` dims, `u32` ggml type, `u64`
//! offset), padding to `general.alignment` (default 32), then the tensor data; each tensor's offset
//! is relative to the start of the data and a multiple of the alignment.
//!
//! **Shapes.** GGUF stores dims innermost-first (`ne[0]` is the contiguous row length). This module
//! reports [`GgufTensorInfo::shape`] in row-major order, i.e. reversed, so a weight that the
//! official checkpoint stores as `[out, in]` has GGUF dims `[in, out]` and `shape == [out, in]`;
//! the raw GGUF order is kept in [`GgufTensorInfo::dims`]. Quantised blocks never straddle rows
//! (the row length must be a multiple of the block size), so rows decode independently
//! ([`GgufFile::f32_rows`]).
//!
//! Dequantisation supports F32, F16, BF16, F64, I8, I16, I32, I64, Q8_0, Q4_K, Q2_K and IQ2_XXS
//! (the types antirez/ds4 writes for DeepSeek V4); other ggml types are parsed and
//! range-checked but [`GgufFile::f32`] refuses them.

use memmap2::Mmap;
use rayon::prelude::*;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use crate::quant;

/// ggml tensor types (the numeric ids are the file format's).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
    NVFP4,
    Q1_0,
}

impl GgmlType {
    /// `(id, type, values per block, bytes per block)`, from the ggml/GGUF specification.
    const TABLE: [(u32, GgmlType, usize, usize); 34] = [
        (0, GgmlType::F32, 1, 4),
        (1, GgmlType::F16, 1, 2),
        (2, GgmlType::Q4_0, 32, 18),
        (3, GgmlType::Q4_1, 32, 20),
        (6, GgmlType::Q5_0, 32, 22),
        (7, GgmlType::Q5_1, 32, 24),
        (8, GgmlType::Q8_0, 32, 34),
        (9, GgmlType::Q8_1, 32, 40),
        (10, GgmlType::Q2_K, 256, 84),
        (11, GgmlType::Q3_K, 256, 110),
        (12, GgmlType::Q4_K, 256, 144),
        (13, GgmlType::Q5_K, 256, 176),
        (14, GgmlType::Q6_K, 256, 210),
        (15, GgmlType::Q8_K, 256, 292),
        (16, GgmlType::IQ2_XXS, 256, 66),
        (17, GgmlType::IQ2_XS, 256, 74),
        (18, GgmlType::IQ3_XXS, 256, 98),
        (19, GgmlType::IQ1_S, 256, 50),
        (20, GgmlType::IQ4_NL, 32, 18),
        (21, GgmlType::IQ3_S, 256, 110),
        (22, GgmlType::IQ2_S, 256, 82),
        (23, GgmlType::IQ4_XS, 256, 136),
        (24, GgmlType::I8, 1, 1),
        (25, GgmlType::I16, 1, 2),
        (26, GgmlType::I32, 1, 4),
        (27, GgmlType::I64, 1, 8),
        (28, GgmlType::F64, 1, 8),
        (29, GgmlType::IQ1_M, 256, 56),
        (30, GgmlType::BF16, 1, 2),
        (34, GgmlType::TQ1_0, 256, 54),
        (35, GgmlType::TQ2_0, 256, 66),
        (39, GgmlType::MXFP4, 32, 17),
        (40, GgmlType::NVFP4, 64, 36),
        (41, GgmlType::Q1_0, 128, 18),
    ];

    fn entry(self) -> (u32, GgmlType, usize, usize) {
        *Self::TABLE.iter().find(|e| e.1 == self).expect("every type is in the table")
    }

    pub fn from_id(id: u32) -> Option<Self> {
        Self::TABLE.iter().find(|e| e.0 == id).map(|e| e.1)
    }
    pub fn id(self) -> u32 {
        self.entry().0
    }
    /// Values per block (1 for plain types).
    pub fn block_size(self) -> usize {
        self.entry().2
    }
    /// Bytes per block.
    pub fn type_size(self) -> usize {
        self.entry().3
    }
    /// Bytes of a row of `n` values (`n` a multiple of [`Self::block_size`]).
    pub fn row_bytes(self, n: usize) -> usize {
        n / self.block_size() * self.type_size()
    }
    /// Whether [`GgufFile::f32`] can decode this type.
    pub fn can_dequantize(self) -> bool {
        use GgmlType::*;
        matches!(self, F32 | F16 | BF16 | F64 | I8 | I16 | I32 | I64 | Q8_0 | Q4_K | Q2_K | IQ2_XXS)
    }
    /// The name ggml uses (`Q4_K`, `IQ2_XXS`, ...).
    pub fn name(self) -> String {
        format!("{self:?}")
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    /// GGUF strings are UTF-8; invalid sequences are replaced (U+FFFD) rather than refused.
    String(String),
    Array(Vec<GgufValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    /// Any integer type (and bool) that fits in `u64`.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v as u64),
            GgufValue::U16(v) => Some(v as u64),
            GgufValue::U32(v) => Some(v as u64),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            GgufValue::Bool(v) => Some(v as u64),
            _ => None,
        }
    }
    /// Any integer type that fits in `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::I8(v) => Some(v as i64),
            GgufValue::I16(v) => Some(v as i64),
            GgufValue::I32(v) => Some(v as i64),
            GgufValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }
    /// Any numeric type as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v as f64),
            GgufValue::F64(v) => Some(v),
            GgufValue::Bool(_) | GgufValue::String(_) | GgufValue::Array(_) => None,
            _ => self.as_i64().map(|v| v as f64).or_else(|| self.as_u64().map(|v| v as f64)),
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(v) => Some(v),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(v) => Some(v),
            _ => None,
        }
    }
}

/// A GGUF problem; every variant names the file, and the tensor where one is involved.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: bad GGUF header: {msg}")]
    Header { path: String, msg: String },
    #[error(
        "{path}: tensor `{tensor}` needs bytes {start}..{end} but the file has only {file_len} bytes (truncated file?)"
    )]
    Truncated { path: String, tensor: String, start: u64, end: u64, file_len: u64 },
    #[error("{path}: tensor `{tensor}`: {msg}")]
    Tensor { path: String, tensor: String, msg: String },
    #[error("{path}: no tensor `{tensor}`")]
    Missing { path: String, tensor: String },
}

impl From<GgufError> for crate::store::LoadError {
    fn from(e: GgufError) -> Self {
        use crate::store::LoadError;
        match e {
            GgufError::Io { path, source } => LoadError::Io { path, source },
            GgufError::Header { path, msg } => LoadError::Format { path, msg: format!("bad GGUF header: {msg}") },
            GgufError::Truncated { path, tensor, start, end, file_len } => {
                LoadError::Truncated { path, tensor, start, end, file_len }
            }
            GgufError::Tensor { path, tensor, msg } => LoadError::Value { name: tensor, msg: format!("{path}: {msg}") },
            GgufError::Missing { path, tensor } => LoadError::Missing { name: tensor, tried: path },
        }
    }
}

/// One tensor's header entry.
#[derive(Clone, Debug)]
pub struct GgufTensorInfo {
    pub name: String,
    pub dtype: GgmlType,
    /// Dims as stored, innermost (contiguous) first: `dims[0]` is the row length.
    pub dims: Vec<u64>,
    /// Row-major shape, i.e. `dims` reversed: `[.., rows, cols]`.
    pub shape: Vec<usize>,
    /// Offset of the data from the start of the file's data section.
    pub offset: u64,
    /// Bytes of data.
    pub n_bytes: u64,
}

impl GgufTensorInfo {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Row length (`dims[0]`; 1 for a 0-d tensor).
    pub fn cols(&self) -> usize {
        self.dims.first().map_or(1, |&d| d as usize)
    }
    /// Number of rows: the product of every dim but the innermost.
    pub fn rows(&self) -> usize {
        self.dims.iter().skip(1).map(|&d| d as usize).product()
    }
    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.cols())
    }
}

/// A memory-mapped GGUF file; tensor data is read only when asked for.
pub struct GgufFile {
    path: PathBuf,
    map: Mmap,
    version: u32,
    alignment: u64,
    data_start: usize,
    metadata: Vec<(String, GgufValue)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    index: HashMap<String, usize>,
}

const VT_UINT8: u32 = 0;
const VT_INT8: u32 = 1;
const VT_UINT16: u32 = 2;
const VT_INT16: u32 = 3;
const VT_UINT32: u32 = 4;
const VT_INT32: u32 = 5;
const VT_FLOAT32: u32 = 6;
const VT_BOOL: u32 = 7;
const VT_STRING: u32 = 8;
const VT_ARRAY: u32 = 9;
const VT_UINT64: u32 = 10;
const VT_INT64: u32 = 11;
const VT_FLOAT64: u32 = 12;

/// Most dims a tensor may have (ggml's `GGML_MAX_DIMS`).
const MAX_DIMS: u32 = 4;
/// Deepest nesting of metadata arrays accepted.
const MAX_DEPTH: usize = 8;

/// A bounds-checked little-endian reader over the header bytes.
struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        if n > self.b.len() - self.pos {
            return Err(format!("{what} at byte {} runs past the end of the file ({} bytes)", self.pos, self.b.len()));
        }
        let s = &self.b[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self, what: &str) -> Result<[u8; N], String> {
        Ok(self.take(N, what)?.try_into().unwrap())
    }
    fn u32(&mut self, what: &str) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }
    fn string(&mut self, what: &str) -> Result<String, String> {
        let n = self.u64(what)?;
        let n = usize::try_from(n).map_err(|_| format!("{what}: length {n} too large"))?;
        Ok(String::from_utf8_lossy(self.take(n, what)?).into_owned())
    }
    fn value(&mut self, vt: u32, key: &str, depth: usize) -> Result<GgufValue, String> {
        Ok(match vt {
            VT_UINT8 => GgufValue::U8(self.arr::<1>(key)?[0]),
            VT_INT8 => GgufValue::I8(self.arr::<1>(key)?[0] as i8),
            VT_UINT16 => GgufValue::U16(u16::from_le_bytes(self.arr(key)?)),
            VT_INT16 => GgufValue::I16(i16::from_le_bytes(self.arr(key)?)),
            VT_UINT32 => GgufValue::U32(self.u32(key)?),
            VT_INT32 => GgufValue::I32(i32::from_le_bytes(self.arr(key)?)),
            VT_FLOAT32 => GgufValue::F32(f32::from_le_bytes(self.arr(key)?)),
            VT_BOOL => match self.arr::<1>(key)?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => return Err(format!("key `{key}`: bool byte {b}")),
            },
            VT_STRING => GgufValue::String(self.string(key)?),
            VT_UINT64 => GgufValue::U64(self.u64(key)?),
            VT_INT64 => GgufValue::I64(i64::from_le_bytes(self.arr(key)?)),
            VT_FLOAT64 => GgufValue::F64(f64::from_le_bytes(self.arr(key)?)),
            VT_ARRAY => {
                if depth >= MAX_DEPTH {
                    return Err(format!("key `{key}`: arrays nested deeper than {MAX_DEPTH}"));
                }
                let et = self.u32(key)?;
                let n = self.u64(key)?;
                // Every element takes at least one byte: refuse counts the file cannot hold
                // before allocating for them.
                if n > (self.b.len() - self.pos) as u64 {
                    return Err(format!("key `{key}`: array of {n} elements runs past the end of the file"));
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(et, key, depth + 1)?);
                }
                GgufValue::Array(v)
            }
            t => return Err(format!("key `{key}`: unknown value type {t}")),
        })
    }
}

impl GgufFile {
    /// Opens and validates `path`: header, metadata, tensor infos, and every tensor's byte range
    /// against the file size.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let pstr = path.display().to_string();
        let file = File::open(path).map_err(|source| GgufError::Io { path: pstr.clone(), source })?;
        // SAFETY: the checkpoint is opened read-only; like every mmap-based loader we assume the
        // file is not truncated or rewritten by another process while the engine runs.
        let map = unsafe { Mmap::map(&file) }.map_err(|source| GgufError::Io { path: pstr.clone(), source })?;
        let hdr = |msg: String| GgufError::Header { path: pstr.clone(), msg };
        let mut c = Cursor { b: &map, pos: 0 };
        let magic = c.arr::<4>("magic").map_err(hdr)?;
        if &magic != b"GGUF" {
            return Err(hdr(format!("magic {magic:02x?} is not `GGUF`")));
        }
        let version = c.u32("version").map_err(hdr)?;
        if version.swap_bytes() == 2 || version.swap_bytes() == 3 {
            return Err(hdr(format!("big-endian GGUF (version {}) is not supported", version.swap_bytes())));
        }
        if version != 2 && version != 3 {
            return Err(hdr(format!("version {version} is not supported (2 or 3)")));
        }
        let n_tensors = c.u64("tensor count").map_err(hdr)?;
        let n_kv = c.u64("metadata count").map_err(hdr)?;
        // Each key/value takes at least 12 bytes and each tensor info at least 24.
        if n_kv > map.len() as u64 / 12 || n_tensors > map.len() as u64 / 24 {
            return Err(hdr(format!("{n_kv} metadata entries and {n_tensors} tensors cannot fit in the file")));
        }
        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut meta_index = HashMap::new();
        for _ in 0..n_kv {
            let key = c.string("metadata key").map_err(hdr)?;
            let vt = c.u32(&key).map_err(hdr)?;
            let v = c.value(vt, &key, 0).map_err(hdr)?;
            if meta_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(hdr(format!("metadata key `{key}` appears twice")));
            }
            metadata.push((key, v));
        }
        let alignment = match meta_index.get("general.alignment").map(|&i| &metadata[i].1) {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a.is_power_of_two() => a,
                _ => return Err(hdr(format!("general.alignment {v:?} is not a power of two"))),
            },
        };
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut index = HashMap::new();
        for _ in 0..n_tensors {
            let name = c.string("tensor name").map_err(hdr)?;
            let bad = |msg: String| GgufError::Tensor { path: pstr.clone(), tensor: name.clone(), msg };
            let n_dims = c.u32(&name).map_err(hdr)?;
            if n_dims > MAX_DIMS {
                return Err(bad(format!("{n_dims} dims (at most {MAX_DIMS})")));
            }
            let dims = (0..n_dims).map(|_| c.u64(&name)).collect::<Result<Vec<_>, _>>().map_err(hdr)?;
            let tid = c.u32(&name).map_err(hdr)?;
            let offset = c.u64(&name).map_err(hdr)?;
            let dtype = GgmlType::from_id(tid).ok_or_else(|| bad(format!("unknown ggml type {tid}")))?;
            let numel = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).filter(|&n| n <= usize::MAX as u64);
            let Some(numel) = numel else {
                return Err(bad(format!("dims {dims:?} overflow")));
            };
            let cols = dims.first().copied().unwrap_or(1);
            if cols % dtype.block_size() as u64 != 0 {
                return Err(bad(format!(
                    "row length {cols} is not a multiple of the {dtype} block size {}",
                    dtype.block_size()
                )));
            }
            if offset % alignment != 0 {
                return Err(bad(format!("offset {offset} is not a multiple of the alignment {alignment}")));
            }
            let n_bytes = numel / dtype.block_size() as u64 * dtype.type_size() as u64;
            let shape = dims.iter().rev().map(|&d| d as usize).collect();
            if index.insert(name.clone(), tensors.len()).is_some() {
                return Err(bad("appears twice".into()));
            }
            tensors.push(GgufTensorInfo { name, dtype, dims, shape, offset, n_bytes });
        }
        let data_start = c.pos.div_ceil(alignment as usize) * alignment as usize;
        let data_len = map.len().saturating_sub(data_start) as u64;
        for t in &tensors {
            let end = t.offset.checked_add(t.n_bytes);
            if end.is_none_or(|e| e > data_len) {
                return Err(GgufError::Truncated {
                    path: pstr.clone(),
                    tensor: t.name.clone(),
                    start: t.offset,
                    end: end.unwrap_or(u64::MAX),
                    file_len: data_len,
                });
            }
        }
        Ok(GgufFile {
            path: path.to_path_buf(),
            map,
            version,
            alignment,
            data_start,
            metadata,
            meta_index,
            tensors,
            index,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn version(&self) -> u32 {
        self.version
    }
    /// Data alignment (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }
    /// File offset where tensor data starts.
    pub fn data_start(&self) -> usize {
        self.data_start
    }

    pub fn metadata(&self, key: &str) -> Option<&GgufValue> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }
    /// All metadata, in file order.
    pub fn metadata_all(&self) -> &[(String, GgufValue)] {
        &self.metadata
    }

    /// All tensor infos, in file order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }
    pub fn info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn get(&self, name: &str) -> Result<&GgufTensorInfo, GgufError> {
        self.info(name).ok_or_else(|| GgufError::Missing { path: self.path_str(), tensor: name.into() })
    }
    fn path_str(&self) -> String {
        self.path.display().to_string()
    }
    fn err(&self, t: &GgufTensorInfo, msg: String) -> GgufError {
        GgufError::Tensor { path: self.path_str(), tensor: t.name.clone(), msg }
    }

    /// The raw bytes of a tensor (blocks in ggml's layout, rows innermost-first).
    pub fn raw(&self, name: &str) -> Result<&[u8], GgufError> {
        let t = self.get(name)?;
        let s = self.data_start + t.offset as usize;
        Ok(&self.map[s..s + t.n_bytes as usize])
    }

    /// The whole tensor as f32 (row-major, see [`GgufTensorInfo::shape`]), dequantising any type
    /// for which [`GgmlType::can_dequantize`] holds. Integer types are converted with `as f32`.
    pub fn f32(&self, name: &str) -> Result<Vec<f32>, GgufError> {
        let t = self.get(name)?;
        self.f32_rows(name, 0, t.rows())
    }

    /// Rows `row0..row0+nrows` as f32 (`nrows · cols` values), decoding only those rows: a slice of
    /// a stacked `[experts, out, in]` tensor is rows `e·out..(e+1)·out`.
    pub fn f32_rows(&self, name: &str, row0: usize, nrows: usize) -> Result<Vec<f32>, GgufError> {
        let t = self.get(name)?;
        if row0.checked_add(nrows).is_none_or(|e| e > t.rows()) {
            return Err(self.err(t, format!("rows {row0}..{row0}+{nrows} beyond its {} rows", t.rows())));
        }
        if !t.dtype.can_dequantize() {
            return Err(self.err(t, format!("cannot dequantize type {}", t.dtype)));
        }
        let (cols, rb) = (t.cols(), t.row_bytes());
        let raw = &self.raw(name)?[row0 * rb..(row0 + nrows) * rb];
        let mut out = vec![0f32; nrows * cols];
        if cols == 0 {
            return Ok(out);
        }
        let dtype = t.dtype;
        // Parallel over chunks of whole rows (at least 64K values each) for large tensors.
        let rows_per_task = (65536 / cols).max(1);
        out.par_chunks_mut(rows_per_task * cols)
            .zip(raw.par_chunks(rows_per_task * rb))
            .for_each(|(o, r)| decode(dtype, r, o));
        Ok(out)
    }

    /// An I32 tensor (e.g. ds4's `ffn_gate_tid2eid`) as i32, row-major.
    pub fn i32(&self, name: &str) -> Result<Vec<i32>, GgufError> {
        let t = self.get(name)?;
        if t.dtype != GgmlType::I32 {
            return Err(self.err(t, format!("expected I32, found {}", t.dtype)));
        }
        Ok(self.raw(name)?.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect())
    }
}

/// Decodes whole rows of `dtype` from `src` into `out` (sizes already checked; `dtype` must
/// satisfy [`GgmlType::can_dequantize`]).
pub fn decode(dtype: GgmlType, src: &[u8], out: &mut [f32]) {
    fn each<const N: usize>(src: &[u8], out: &mut [f32], f: impl Fn([u8; N]) -> f32) {
        for (o, c) in out.iter_mut().zip(src.chunks_exact(N)) {
            *o = f(c.try_into().unwrap());
        }
    }
    match dtype {
        GgmlType::F32 => each(src, out, f32::from_le_bytes),
        GgmlType::F16 => each(src, out, |b| half::f16::from_le_bytes(b).to_f32()),
        GgmlType::BF16 => each(src, out, |b| half::bf16::from_le_bytes(b).to_f32()),
        GgmlType::F64 => each(src, out, |b| f64::from_le_bytes(b) as f32),
        GgmlType::I8 => each(src, out, |b: [u8; 1]| b[0] as i8 as f32),
        GgmlType::I16 => each(src, out, |b| i16::from_le_bytes(b) as f32),
        GgmlType::I32 => each(src, out, |b| i32::from_le_bytes(b) as f32),
        GgmlType::I64 => each(src, out, |b| i64::from_le_bytes(b) as f32),
        GgmlType::Q8_0 => quant::dequant_q8_0(src, out),
        GgmlType::Q4_K => quant::dequant_q4_k(src, out),
        GgmlType::Q2_K => quant::dequant_q2_k(src, out),
        GgmlType::IQ2_XXS => quant::dequant_iq2_xxs(src, out),
        other => unreachable!("{other} is not decodable"),
    }
}

/// A routed-expert weight of ds4's GGUFs: all experts of one layer stacked in one tensor,
/// `blk.{layer}.ffn_{gate,up,down}_exps.weight`, GGUF dims `[in, out, n_experts]` (row-major
/// `[n_experts, out, in]`): expert `e` is rows `e·out..(e+1)·out`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GgufExperts {
    pub layer: usize,
    /// `"w1"` (gate), `"w3"` (up) or `"w2"` (down), as in the official names.
    pub part: &'static str,
}

impl GgufExperts {
    /// The official name of expert `e`'s matrix, e.g. `layers.3.ffn.experts.17.w1.weight`.
    pub fn official(&self, expert: usize) -> String {
        format!("layers.{}.ffn.experts.{expert}.{}.weight", self.layer, self.part)
    }
}

/// Top-level tensors of ds4's DeepSeek V4 GGUFs → official names.
const DS4_TOP: [(&str, &str); 6] = [
    ("token_embd.weight", "embed.weight"),
    ("output_norm.weight", "norm.weight"),
    ("output.weight", "head.weight"),
    ("output_hc_base.weight", "hc_head_base"),
    ("output_hc_fn.weight", "hc_head_fn"),
    ("output_hc_scale.weight", "hc_head_scale"),
];

/// Per-layer tensors (`blk.{l}.` + GGUF suffix → `layers.{l}.` + official suffix).
const DS4_LAYER: [(&str, &str); 32] = [
    ("hc_attn_base.weight", "hc_attn_base"),
    ("hc_attn_fn.weight", "hc_attn_fn"),
    ("hc_attn_scale.weight", "hc_attn_scale"),
    ("hc_ffn_base.weight", "hc_ffn_base"),
    ("hc_ffn_fn.weight", "hc_ffn_fn"),
    ("hc_ffn_scale.weight", "hc_ffn_scale"),
    ("attn_sinks.weight", "attn.attn_sink"),
    ("attn_q_a.weight", "attn.wq_a.weight"),
    ("attn_q_b.weight", "attn.wq_b.weight"),
    ("attn_q_a_norm.weight", "attn.q_norm.weight"),
    ("attn_kv.weight", "attn.wkv.weight"),
    ("attn_kv_a_norm.weight", "attn.kv_norm.weight"),
    ("attn_output_a.weight", "attn.wo_a.weight"),
    ("attn_output_b.weight", "attn.wo_b.weight"),
    ("attn_compressor_ape.weight", "attn.compressor.ape"),
    ("attn_compressor_kv.weight", "attn.compressor.wkv.weight"),
    ("attn_compressor_gate.weight", "attn.compressor.wgate.weight"),
    ("attn_compressor_norm.weight", "attn.compressor.norm.weight"),
    ("indexer.attn_q_b.weight", "attn.indexer.wq_b.weight"),
    ("indexer.proj.weight", "attn.indexer.weights_proj.weight"),
    ("indexer_compressor_ape.weight", "attn.indexer.compressor.ape"),
    ("indexer_compressor_kv.weight", "attn.indexer.compressor.wkv.weight"),
    ("indexer_compressor_gate.weight", "attn.indexer.compressor.wgate.weight"),
    ("indexer_compressor_norm.weight", "attn.indexer.compressor.norm.weight"),
    ("attn_norm.weight", "attn_norm.weight"),
    ("ffn_norm.weight", "ffn_norm.weight"),
    ("ffn_gate_shexp.weight", "ffn.shared_experts.w1.weight"),
    ("ffn_up_shexp.weight", "ffn.shared_experts.w3.weight"),
    ("ffn_down_shexp.weight", "ffn.shared_experts.w2.weight"),
    ("ffn_gate_inp.weight", "ffn.gate.weight"),
    ("exp_probs_b.bias", "ffn.gate.bias"),
    ("ffn_gate_tid2eid.weight", "ffn.gate.tid2eid"),
];

/// `blk.{l}.rest` → `(l, rest)`.
fn split_block(name: &str) -> Option<(usize, &str)> {
    let rest = name.strip_prefix("blk.")?;
    let (l, rest) = rest.split_once('.')?;
    if l.is_empty() || !l.bytes().all(|b| b.is_ascii_digit()) || (l.len() > 1 && l.starts_with('0')) {
        return None;
    }
    Some((l.parse().ok()?, rest))
}

/// The official DeepSeek V4 name of a tensor in antirez/ds4's GGUFs, e.g.
/// `blk.2.attn_q_a.weight` → `layers.2.attn.wq_a.weight`. The table is the one ds4's
/// `gguf-tools/deepseek4-quantize.c` (antirez/ds4 at `8d57664`) uses to fill its GGUFs from the
/// official checkpoint; that tool checks every GGUF dims list against the official shape reversed,
/// so [`GgufTensorInfo::shape`] equals the official shape (no transposes). `None` for the stacked
/// routed experts (see [`gguf_experts`]), the separate MTP GGUF's `mtp.0.*` tensors, and unknown
/// names. ds4 stores `ffn.gate.tid2eid` as I32 (official: int64) and omits `exp_probs_b.bias` on
/// hash-routed layers, as the official checkpoint does.
pub fn gguf_to_official(name: &str) -> Option<String> {
    if let Some((_, o)) = DS4_TOP.iter().find(|(g, _)| *g == name) {
        return Some(o.to_string());
    }
    let (l, rest) = split_block(name)?;
    DS4_LAYER.iter().find(|(g, _)| *g == rest).map(|(_, o)| format!("layers.{l}.{o}"))
}

/// The ds4 GGUF name of an official (or `model.`-prefixed official) tensor name: the inverse of
/// [`gguf_to_official`]. `None` for routed experts (see [`official_expert_to_gguf`]) and unknown
/// names.
pub fn official_to_gguf(official: &str) -> Option<String> {
    let official = official.strip_prefix("model.").unwrap_or(official);
    if let Some((g, _)) = DS4_TOP.iter().find(|(_, o)| *o == official) {
        return Some(g.to_string());
    }
    let rest = official.strip_prefix("layers.")?;
    let (l, rest) = rest.split_once('.')?;
    if l.is_empty() || !l.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    DS4_LAYER.iter().find(|(_, o)| *o == rest).map(|(g, _)| format!("blk.{l}.{g}"))
}

/// The stacked ds4 tensor holding an official routed-expert matrix and the expert's index:
/// `layers.3.ffn.experts.17.w1.weight` → (`blk.3.ffn_gate_exps.weight`, 17).
pub fn official_expert_to_gguf(official: &str) -> Option<(String, usize)> {
    let official = official.strip_prefix("model.").unwrap_or(official);
    let rest = official.strip_prefix("layers.")?;
    let (l, rest) = rest.split_once('.')?;
    let rest = rest.strip_prefix("ffn.experts.")?;
    let (e, part) = rest.split_once('.')?;
    let part = match part {
        "w1.weight" => "gate",
        "w3.weight" => "up",
        "w2.weight" => "down",
        _ => return None,
    };
    let (l, e): (usize, usize) = (l.parse().ok()?, e.parse().ok()?);
    Some((format!("blk.{l}.ffn_{part}_exps.weight"), e))
}

/// The metadata key under which `dsv4 quantize` stores the model's `config.json` text, which
/// makes its GGUFs self-describing.
pub const CONFIG_KEY: &str = "dsv4.config_json";

impl GgufFile {
    /// The model configuration: the one stored under [`CONFIG_KEY`] by `dsv4 quantize`, else
    /// (antirez/ds4's GGUFs) one built from ds4's metadata keys and the tensor shapes
    /// ([`crate::gguf_config::ds4_config`]).
    pub fn config(&self) -> Result<crate::config::Config, crate::store::LoadError> {
        use crate::store::LoadError;
        let path = self.path_str();
        let Some(v) = self.metadata(CONFIG_KEY) else {
            return crate::gguf_config::ds4_config(self);
        };
        let text = v
            .as_str()
            .ok_or_else(|| LoadError::Format { path: path.clone(), msg: format!("`{CONFIG_KEY}` is not a string") })?;
        let json: serde_json::Value = serde_json::from_str(text).map_err(|e| LoadError::Format {
            path: path.clone(),
            msg: format!("`{CONFIG_KEY}` is not valid JSON: {e}"),
        })?;
        Ok(crate::config::Config::from_json(&json)?)
    }

    /// Total bytes of tensor data.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.n_bytes).sum()
    }
}

/// Recognises ds4's stacked routed-expert tensors `blk.{l}.ffn_{gate,up,down}_exps.weight`.
pub fn gguf_experts(name: &str) -> Option<GgufExperts> {
    let (layer, rest) = split_block(name)?;
    let part = match rest {
        "ffn_gate_exps.weight" => "w1",
        "ffn_up_exps.weight" => "w3",
        "ffn_down_exps.weight" => "w2",
        _ => return None,
    };
    Some(GgufExperts { layer, part })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ds4_names_map_to_official() {
        let cases = [
            ("token_embd.weight", "embed.weight"),
            ("output.weight", "head.weight"),
            ("output_norm.weight", "norm.weight"),
            ("output_hc_fn.weight", "hc_head_fn"),
            ("output_hc_scale.weight", "hc_head_scale"),
            ("blk.0.hc_attn_fn.weight", "layers.0.hc_attn_fn"),
            ("blk.0.ffn_gate_tid2eid.weight", "layers.0.ffn.gate.tid2eid"),
            ("blk.2.attn_q_a.weight", "layers.2.attn.wq_a.weight"),
            ("blk.2.attn_kv_a_norm.weight", "layers.2.attn.kv_norm.weight"),
            ("blk.2.attn_sinks.weight", "layers.2.attn.attn_sink"),
            ("blk.2.indexer.attn_q_b.weight", "layers.2.attn.indexer.wq_b.weight"),
            ("blk.2.indexer.proj.weight", "layers.2.attn.indexer.weights_proj.weight"),
            ("blk.2.indexer_compressor_ape.weight", "layers.2.attn.indexer.compressor.ape"),
            ("blk.3.attn_compressor_norm.weight", "layers.3.attn.compressor.norm.weight"),
            ("blk.42.exp_probs_b.bias", "layers.42.ffn.gate.bias"),
            ("blk.42.ffn_gate_inp.weight", "layers.42.ffn.gate.weight"),
            ("blk.42.ffn_up_shexp.weight", "layers.42.ffn.shared_experts.w3.weight"),
            ("blk.10.ffn_down_shexp.weight", "layers.10.ffn.shared_experts.w2.weight"),
        ];
        for (g, o) in cases {
            assert_eq!(gguf_to_official(g).as_deref(), Some(o), "{g}");
        }
        for bad in [
            "blk.x.attn_q_a.weight",
            "blk..attn_q_a.weight",
            "blk.01.attn_q_a.weight",
            "blk.1.nope",
            "mtp.0.e_proj.weight",
            "blk.1.ffn_gate_exps.weight",
        ] {
            assert_eq!(gguf_to_official(bad), None, "{bad}");
        }
    }

    #[test]
    fn ds4_every_official_layer_name_maps_back_through_hf_name() {
        // Every mapped official name is one that weights.rs knows (it has an HF form, or is global).
        for (_, o) in DS4_LAYER {
            let off = format!("layers.7.{o}");
            assert_ne!(crate::weights::hf_name(&off), off, "{off} unknown to hf_name");
        }
    }

    #[test]
    fn official_names_map_back_to_ds4() {
        for (g, _) in DS4_TOP {
            assert_eq!(official_to_gguf(&gguf_to_official(g).unwrap()).as_deref(), Some(g));
        }
        for (g, _) in DS4_LAYER {
            let g = format!("blk.13.{g}");
            let o = gguf_to_official(&g).unwrap();
            assert_eq!(official_to_gguf(&o).as_deref(), Some(g.as_str()));
            assert_eq!(official_to_gguf(&format!("model.{o}")).as_deref(), Some(g.as_str()));
        }
        assert_eq!(official_to_gguf("layers.1.ffn.experts.0.w1.weight"), None);
        assert_eq!(official_to_gguf("layers.x.attn_norm.weight"), None);
        for (o, g, e) in [
            ("layers.3.ffn.experts.17.w1.weight", "blk.3.ffn_gate_exps.weight", 17),
            ("model.layers.0.ffn.experts.0.w3.weight", "blk.0.ffn_up_exps.weight", 0),
            ("layers.42.ffn.experts.255.w2.weight", "blk.42.ffn_down_exps.weight", 255),
        ] {
            assert_eq!(official_expert_to_gguf(o), Some((g.to_string(), e)));
            let ge = gguf_experts(g).unwrap();
            assert_eq!(ge.official(e), o.trim_start_matches("model."));
        }
        assert_eq!(official_expert_to_gguf("layers.3.ffn.shared_experts.w1.weight"), None);
    }

    #[test]
    fn ds4_expert_tensors() {
        let e = gguf_experts("blk.5.ffn_gate_exps.weight").unwrap();
        assert_eq!(e, GgufExperts { layer: 5, part: "w1" });
        assert_eq!(e.official(17), "layers.5.ffn.experts.17.w1.weight");
        assert_eq!(gguf_experts("blk.5.ffn_up_exps.weight").unwrap().part, "w3");
        assert_eq!(gguf_experts("blk.5.ffn_down_exps.weight").unwrap().part, "w2");
        assert_eq!(gguf_experts("blk.5.ffn_gate_shexp.weight"), None);
    }

    #[test]
    fn type_table_is_consistent() {
        for (id, t, bs, ts) in GgmlType::TABLE {
            assert_eq!(GgmlType::from_id(id), Some(t));
            assert_eq!((t.id(), t.block_size(), t.type_size()), (id, bs, ts));
        }
        assert_eq!(GgmlType::from_id(4), None);
        assert_eq!(GgmlType::Q4_K.row_bytes(512), 288);
    }
}
