//! The logical weight layout of DeepSeek V4 and its loader.
//!
//! [`Weights<W>`] is generic over the backend's tensor handle: the loader reads each tensor from
//! a [`TensorStore`] under its official or HF name (or from a GGUF under ds4's names, see
//! [`Source`]), checks shape and dtype against the config,
//! dequantises FP8/FP4 to f32 and hands it to the backend's `upload` callback, so a checkpoint is
//! never held twice in host memory.

use crate::config::{AttnKind, Config, Layout};
use crate::gguf::{official_expert_to_gguf, official_to_gguf, GgufFile};
use crate::packed::{Packed, PackedFormat};
use crate::shard::{Part, Shard};
use crate::store::{DType, LoadError, TensorStore};
use std::path::{Path, PathBuf};

/// A tensor on its way to a backend: f32 values, or (when the loader was asked to keep them,
/// see [`LoadOptions`]) the file's blocks in `packed` with `data` empty.
#[derive(Clone, Debug)]
pub struct HostTensor {
    /// The logical (official-layout) name, used in messages and captures.
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
    pub packed: Option<Packed>,
}

impl HostTensor {
    /// An f32 tensor.
    pub fn new(name: impl Into<String>, shape: Vec<usize>, data: Vec<f32>) -> Self {
        HostTensor { name: name.into(), shape, data, packed: None }
    }

    /// `(rows, cols)`: a 1-D tensor is one row.
    pub fn rows_cols(&self) -> (usize, usize) {
        match self.shape.as_slice() {
            [c] => (1, *c),
            [r, c] => (*r, *c),
            s => (s.iter().product(), 1),
        }
    }

    /// Replaces packed blocks by their f32 values (for backends that hold f32).
    pub fn dequantize(&mut self) {
        if let Some(p) = self.packed.take() {
            let (r, c) = self.rows_cols();
            self.data = p.dequantize(r, c);
        }
    }

    /// Bytes a backend holding this tensor as handed over needs (f32 or packed).
    pub fn host_bytes(&self) -> u64 {
        let (r, c) = self.rows_cols();
        match &self.packed {
            Some(p) => Packed::bytes_of(p.format, r, c),
            None => (r * c * 4) as u64,
        }
    }
}

/// How [`load_weights_with`] hands tensors over.
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadOptions {
    /// Keep FP8, FP4 and GGUF block weights (2-D) in their stored format instead of
    /// dequantising them; the backend decides what it keeps ([`HostTensor::dequantize`]).
    pub keep_packed: bool,
    /// Read no tensor data: every tensor arrives with empty `data` (and empty blocks when
    /// packed), so a backend can total what it would allocate before allocating anything.
    pub dry: bool,
    /// Which rank's share to load ([`Shard::WHOLE`] by default): routed experts it does not own
    /// are never read; split tensors are read whole and cut before upload.
    pub shard: Shard,
}

/// mHC parameters: `fn [(2+n)·n, n·d]`, `base [(2+n)·n]`, `scale [3]` (head: `[n, n·d]`, `[n]`, `[1]`).
pub struct Hc<W> {
    pub fn_: W,
    pub base: W,
    pub scale: W,
}

/// A KV compressor (CSA, HCA, or the indexer's own).
pub struct Compressor<W> {
    pub wkv: W,
    pub wgate: W,
    pub ape: W,
    pub norm: W,
}

/// The lightning indexer of a CSA layer.
pub struct Indexer<W> {
    pub wq_b: W,
    pub weights_proj: W,
    pub compressor: Compressor<W>,
}

pub struct Attention<W> {
    pub wq_a: W,
    pub q_norm: W,
    pub wq_b: W,
    pub wkv: W,
    pub kv_norm: W,
    pub wo_a: W,
    pub wo_b: W,
    pub sinks: W,
    pub compressor: Option<Compressor<W>>,
    pub indexer: Option<Indexer<W>>,
}

/// One clamped-SwiGLU expert: `w1` gate `[I, d]`, `w3` up `[I, d]`, `w2` down `[d, I]`.
pub struct Expert<W> {
    pub w1: W,
    pub w2: W,
    pub w3: W,
}

pub struct Moe<W> {
    pub gate: W,
    /// Selection bias of learned-routing layers.
    pub bias: Option<W>,
    /// Hash routing table `[vocab, k]` of hash layers, row-major.
    pub tid2eid: Option<Vec<u32>>,
    /// The routed experts held here: global ids `expert0..expert0 + experts.len()` (all of them
    /// unless the weights are one rank's share, see [`Shard`]).
    pub experts: Vec<Expert<W>>,
    pub expert0: usize,
    pub shared: Expert<W>,
}

pub struct Layer<W> {
    pub attn_norm: W,
    pub ffn_norm: W,
    pub hc_attn: Hc<W>,
    pub hc_ffn: Hc<W>,
    pub attn: Attention<W>,
    pub ffn: Moe<W>,
}

pub struct Weights<W> {
    pub embed: W,
    pub head: W,
    pub norm: W,
    pub hc_head: Hc<W>,
    pub layers: Vec<Layer<W>>,
}

/// The HF transformers name of an official tensor name (spec §8.1), for everything except the
/// routed experts, which HF fuses.
pub fn hf_name(official: &str) -> String {
    const GLOBAL: [(&str, &str); 6] = [
        ("embed.weight", "model.embed_tokens.weight"),
        ("head.weight", "lm_head.weight"),
        ("norm.weight", "model.norm.weight"),
        ("hc_head_fn", "model.hc_head.hc_fn"),
        ("hc_head_base", "model.hc_head.hc_base"),
        ("hc_head_scale", "model.hc_head.hc_scale"),
    ];
    for (o, h) in GLOBAL {
        if official == o {
            return h.to_string();
        }
    }
    // Longest patterns first: `attn.indexer.compressor.` before `attn.compressor.`.
    const LAYER: [(&str, &str); 31] = [
        (".attn_norm.weight", ".input_layernorm.weight"),
        (".ffn_norm.weight", ".post_attention_layernorm.weight"),
        (".hc_attn_fn", ".attn_hc.fn"),
        (".hc_attn_base", ".attn_hc.base"),
        (".hc_attn_scale", ".attn_hc.scale"),
        (".hc_ffn_fn", ".ffn_hc.fn"),
        (".hc_ffn_base", ".ffn_hc.base"),
        (".hc_ffn_scale", ".ffn_hc.scale"),
        (".attn.indexer.compressor.wkv.", ".self_attn.compressor.indexer.kv_proj."),
        (".attn.indexer.compressor.wgate.", ".self_attn.compressor.indexer.gate_proj."),
        (".attn.indexer.compressor.ape", ".self_attn.compressor.indexer.position_bias"),
        (".attn.indexer.compressor.norm.", ".self_attn.compressor.indexer.kv_norm."),
        (".attn.indexer.wq_b.", ".self_attn.compressor.indexer.q_b_proj."),
        (".attn.indexer.weights_proj.", ".self_attn.compressor.indexer.scorer.weights_proj."),
        (".attn.compressor.wkv.", ".self_attn.compressor.kv_proj."),
        (".attn.compressor.wgate.", ".self_attn.compressor.gate_proj."),
        (".attn.compressor.ape", ".self_attn.compressor.position_bias"),
        (".attn.compressor.norm.", ".self_attn.compressor.kv_norm."),
        (".attn.wq_a.", ".self_attn.q_a_proj."),
        (".attn.q_norm.", ".self_attn.q_a_norm."),
        (".attn.wq_b.", ".self_attn.q_b_proj."),
        (".attn.wkv.", ".self_attn.kv_proj."),
        (".attn.kv_norm.", ".self_attn.kv_norm."),
        (".attn.wo_a.", ".self_attn.o_a_proj."),
        (".attn.wo_b.", ".self_attn.o_b_proj."),
        (".attn.attn_sink", ".self_attn.sinks"),
        (".ffn.gate.bias", ".mlp.gate.e_score_correction_bias"),
        (".ffn.gate.", ".mlp.gate."),
        (".ffn.shared_experts.w1.", ".mlp.shared_experts.gate_proj."),
        (".ffn.shared_experts.w2.", ".mlp.shared_experts.down_proj."),
        (".ffn.shared_experts.w3.", ".mlp.shared_experts.up_proj."),
    ];
    for (o, h) in LAYER {
        if let Some(i) = official.find(o) {
            return format!("model.{}{}{}", &official[..i], h, &official[i + o.len()..]);
        }
    }
    official.to_string()
}

/// What the loader may accept for a tensor.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// Any float dtype; FP8 with a companion block-scale tensor is dequantised.
    Float,
    /// A routed-expert matrix: float, FP8 block-scaled, or FP4 packed with per-32 scales.
    Expert,
}

/// Where the loader reads tensors from.
#[derive(Clone, Copy)]
pub enum Source<'a> {
    /// Safetensors under HF or official names (F32/BF16/F16, FP8 + scales, FP4 experts).
    Safetensors(&'a TensorStore),
    /// A GGUF under ds4's names (routed experts stacked `[E, out, in]`), any dequantisable type.
    Gguf(&'a GgufFile),
}

impl Source<'_> {
    fn total_bytes(&self) -> u64 {
        match self {
            Source::Safetensors(s) => s.total_bytes(),
            Source::Gguf(g) => g.total_bytes(),
        }
    }
}

/// A checkpoint the loader can read: a safetensors directory or file (with `config.json`), or a
/// GGUF written by `dsv4 quantize` (its configuration in the metadata).
pub enum Checkpoint {
    Safetensors(TensorStore),
    Gguf(GgufFile),
}

impl Checkpoint {
    /// The GGUF that `path` names: a `.gguf` file, or a directory without `config.json` holding
    /// exactly one `.gguf`.
    pub fn gguf_path(path: &Path) -> Option<PathBuf> {
        if path.is_file() {
            return path.extension().is_some_and(|e| e == "gguf").then(|| path.to_path_buf());
        }
        if !path.is_dir() || path.join("config.json").exists() {
            return None;
        }
        let mut g: Vec<PathBuf> = std::fs::read_dir(path)
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
            .collect();
        (g.len() == 1).then(|| g.remove(0))
    }

    /// Opens `path` (see [`Checkpoint::gguf_path`]; otherwise `config.json` + safetensors) and
    /// reads its configuration.
    pub fn open(path: &Path) -> Result<(Config, Checkpoint), LoadError> {
        if let Some(g) = Self::gguf_path(path) {
            let f = GgufFile::open(&g)?;
            let cfg = f.config()?;
            return Ok((cfg, Checkpoint::Gguf(f)));
        }
        let cfg = Config::from_dir(path)?;
        Ok((cfg, Checkpoint::Safetensors(TensorStore::open(path)?)))
    }

    pub fn source(&self) -> Source<'_> {
        match self {
            Checkpoint::Safetensors(s) => Source::Safetensors(s),
            Checkpoint::Gguf(g) => Source::Gguf(g),
        }
    }
}

/// The parts of the model that memory is reported for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Component {
    /// Token embedding and LM head.
    EmbedHead,
    /// Attention: projections, compressors, indexers, sinks and their norms.
    Attention,
    /// Routed experts.
    Experts,
    /// Everything else: shared experts, routers, hash tables, mHC, layer norms.
    Other,
}

impl Component {
    pub const ALL: [Component; 4] = [Component::EmbedHead, Component::Attention, Component::Experts, Component::Other];

    /// The component of an official tensor name (`model.` prefix allowed).
    pub fn of(official: &str) -> Self {
        let n = official.strip_prefix("model.").unwrap_or(official);
        if n == "embed.weight" || n == "head.weight" {
            Component::EmbedHead
        } else if n.contains(".ffn.experts.") {
            Component::Experts
        } else if n.contains(".attn.") {
            Component::Attention
        } else {
            Component::Other
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Component::EmbedHead => "embeddings/head",
            Component::Attention => "attention",
            Component::Experts => "routed experts",
            Component::Other => "other",
        }
    }
}

/// Bytes per component: in the checkpoint file, and as handed to the backend (f32).
#[derive(Clone, Debug, Default)]
pub struct MemoryStats {
    pub file: [u64; 4],
    pub loaded: [u64; 4],
    pub tensors: [usize; 4],
}

impl MemoryStats {
    fn add(&mut self, official: &str, file: u64, loaded: u64) {
        let i = Component::ALL.iter().position(|&c| c == Component::of(official)).unwrap();
        self.file[i] += file;
        self.loaded[i] += loaded;
        self.tensors[i] += 1;
    }
    pub fn file_total(&self) -> u64 {
        self.file.iter().sum()
    }
    pub fn loaded_total(&self) -> u64 {
        self.loaded.iter().sum()
    }
    /// One line: `embeddings/head 1.2 MiB (file 0.6 MiB), ...; total ...`.
    pub fn summary(&self) -> String {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        let parts: Vec<String> = Component::ALL
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{} {:.1} MiB (file {:.1})", c.label(), mib(self.loaded[i]), mib(self.file[i])))
            .collect();
        format!(
            "{}; total {:.1} MiB as f32 (file {:.1} MiB)",
            parts.join(", "),
            mib(self.loaded_total()),
            mib(self.file_total())
        )
    }
    /// A table: component, tensors, file bytes, loaded (f32) bytes.
    pub fn table(&self) -> String {
        let mut s = format!("{:<16} {:>8} {:>16} {:>16}\n", "component", "tensors", "file bytes", "f32 bytes");
        for (i, c) in Component::ALL.iter().enumerate() {
            s += &format!("{:<16} {:>8} {:>16} {:>16}\n", c.label(), self.tensors[i], self.file[i], self.loaded[i]);
        }
        s += &format!(
            "{:<16} {:>8} {:>16} {:>16}\n",
            "total",
            self.tensors.iter().sum::<usize>(),
            self.file_total(),
            self.loaded_total()
        );
        s
    }
}

/// Reads tensors by logical name with shape checks, dequantisation and progress.
pub struct Loader<'a, W, F: FnMut(HostTensor) -> Result<W, LoadError>> {
    src: Source<'a>,
    cfg: &'a Config,
    layout: Layout,
    upload: F,
    progress: Option<indicatif::ProgressBar>,
    stats: MemoryStats,
    opts: LoadOptions,
}

impl<'a, W, F: FnMut(HostTensor) -> Result<W, LoadError>> Loader<'a, W, F> {
    /// Candidate names of a logical tensor, the config's layout first. HF `save_pretrained`
    /// reverses its key conversion on save, so checkpoints it wrote may also carry the official
    /// name under a `model.` prefix, and `norm` where the module says `kv_norm`.
    fn candidates(&self, official: &str) -> Vec<String> {
        let hf = hf_name(official);
        let prefixed = format!("model.{official}");
        let mut v = match self.layout {
            Layout::Official => vec![official.to_string(), hf.clone()],
            Layout::Hf => vec![hf.clone(), official.to_string()],
        };
        v.push(prefixed.clone());
        for n in [&hf, &prefixed] {
            if n.contains(".kv_norm.") {
                v.push(n.replace(".kv_norm.", ".norm."));
            }
        }
        let mut seen = std::collections::HashSet::new();
        v.retain(|n| seen.insert(n.clone()));
        v
    }

    fn resolve(&self, store: &TensorStore, official: &str) -> Result<String, LoadError> {
        let c = self.candidates(official);
        c.iter()
            .find(|n| store.contains(n))
            .cloned()
            .ok_or_else(|| LoadError::Missing { name: official.to_string(), tried: c.join(", ") })
    }

    /// Counts `bytes` of the file towards progress; returns them.
    fn tick_bytes(&self, bytes: u64) -> u64 {
        if let Some(p) = &self.progress {
            p.inc(bytes);
        }
        bytes
    }

    fn tick(&self, store: &TensorStore, name: &str) -> u64 {
        store.info(name).map_or(0, |t| self.tick_bytes((t.numel() * t.dtype.size()) as u64))
    }

    /// FP8/FP4 blocks kept as they are, or dequantised (see [`LoadOptions`]).
    fn packed_or_f32(
        &self,
        format: PackedFormat,
        raw: impl FnOnce() -> Result<Vec<u8>, LoadError>,
        scales: impl FnOnce() -> Result<Vec<f32>, LoadError>,
        rows: usize,
        cols: usize,
    ) -> Result<(Vec<f32>, Option<Packed>), LoadError> {
        if self.opts.dry {
            let keep = self.opts.keep_packed.then(|| Packed { format, blocks: vec![], scales: vec![] });
            return Ok((vec![], keep));
        }
        let p = Packed { format, blocks: raw()?, scales: scales()? };
        if self.opts.keep_packed {
            Ok((vec![], Some(p)))
        } else {
            Ok((p.dequantize(rows, cols), None))
        }
    }

    /// Reads a tensor stored under `name` with the logical `shape`, dequantising FP8/FP4 unless
    /// they are kept packed. Returns the values or blocks and the bytes read from the file.
    fn read(
        &self,
        store: &TensorStore,
        name: &str,
        shape: &[usize],
        kind: Kind,
    ) -> Result<(Vec<f32>, Option<Packed>, u64), LoadError> {
        let info = store.info(name).expect("resolved");
        let found = info.shape.clone();
        let mut bytes = self.tick(store, name);
        let scale_name = [format!("{}.scale", name.trim_end_matches(".weight")), format!("{name}_scale_inv")]
            .into_iter()
            .find(|s| store.contains(s));
        let (rows, cols) = match shape {
            [r, c] => (*r, *c),
            _ => (shape.iter().product(), 1),
        };
        let v = match info.dtype {
            DType::F8E4M3 if shape.len() == 2 => {
                if found != shape {
                    return Err(LoadError::Shape { name: name.into(), expected: shape.to_vec(), found });
                }
                let Some(sn) = scale_name else {
                    return Err(LoadError::Missing {
                        name: format!("{name} scale"),
                        tried: format!("{}.scale", name.trim_end_matches(".weight")),
                    });
                };
                let sshape = vec![rows.div_ceil(128), cols.div_ceil(128)];
                let sinfo = store.info(&sn).unwrap();
                if sinfo.shape != sshape {
                    return Err(LoadError::Shape { name: sn, expected: sshape, found: sinfo.shape.clone() });
                }
                bytes += self.tick(store, &sn);
                let raw = || Ok(store.raw(name)?.to_vec());
                let (v, p) = self.packed_or_f32(PackedFormat::Fp8, raw, || store.f32(&sn), rows, cols)?;
                return Ok((v, p, bytes));
            }
            DType::I8 | DType::U8 if kind == Kind::Expert && shape.len() == 2 => {
                let packed = vec![rows, cols / 2];
                if found != packed || cols % 2 != 0 {
                    return Err(LoadError::Shape { name: name.into(), expected: packed, found });
                }
                let Some(sn) = scale_name else {
                    return Err(LoadError::Missing {
                        name: format!("{name} scale"),
                        tried: format!("{}.scale", name.trim_end_matches(".weight")),
                    });
                };
                let sshape = vec![rows, cols.div_ceil(32)];
                let sinfo = store.info(&sn).unwrap();
                if sinfo.shape != sshape {
                    return Err(LoadError::Shape { name: sn, expected: sshape, found: sinfo.shape.clone() });
                }
                bytes += self.tick(store, &sn);
                let raw = || Ok(store.raw(name)?.to_vec());
                let (v, p) = self.packed_or_f32(PackedFormat::Fp4, raw, || store.f32(&sn), rows, cols)?;
                return Ok((v, p, bytes));
            }
            dt if dt.is_float() => {
                if found != shape {
                    return Err(LoadError::Shape { name: name.into(), expected: shape.to_vec(), found });
                }
                if self.opts.dry {
                    vec![]
                } else {
                    store.f32(name)?
                }
            }
            dt => {
                return Err(LoadError::DType {
                    name: name.into(),
                    expected: "a float type (F32, BF16, F16, F8_E4M3 + scale)".into(),
                    found: dt.name().into(),
                })
            }
        };
        Ok((v, None, bytes))
    }

    /// Hands a tensor to the backend, counting it in the memory statistics.
    fn put(
        &mut self,
        name: String,
        shape: Vec<usize>,
        data: Vec<f32>,
        packed: Option<Packed>,
        file_bytes: u64,
    ) -> Result<W, LoadError> {
        let t = HostTensor { name, shape, data, packed };
        self.stats.add(&t.name, file_bytes, t.host_bytes());
        (self.upload)(t)
    }

    /// Rows `row0..row0+rows` of a GGUF tensor: its blocks kept (a 2-D block type and
    /// [`LoadOptions::keep_packed`]), or decoded to f32.
    fn gguf_rows(
        &self,
        g: &GgufFile,
        name: &str,
        row0: usize,
        rows: usize,
        cols: usize,
    ) -> Result<(Vec<f32>, Option<Packed>), LoadError> {
        let info = g.info(name).expect("resolved");
        let format = PackedFormat::of_ggml(info.dtype).filter(|f| self.opts.keep_packed && f.fits(cols));
        match (format, self.opts.dry) {
            (Some(format), true) => Ok((vec![], Some(Packed { format, blocks: vec![], scales: vec![] }))),
            (None, true) => Ok((vec![], None)),
            (Some(format), false) => {
                let rb = info.row_bytes();
                let blocks = g.raw(name)?[row0 * rb..(row0 + rows) * rb].to_vec();
                Ok((vec![], Some(Packed { format, blocks, scales: vec![] })))
            }
            (None, false) => Ok((g.f32_rows(name, row0, rows)?, None)),
        }
    }

    /// The ds4 name of `official` in a GGUF, checked to exist with `shape`.
    fn gguf_resolve(&self, g: &GgufFile, official: &str, shape: &[usize]) -> Result<String, LoadError> {
        let name = official_to_gguf(official).filter(|n| g.contains(n)).ok_or_else(|| LoadError::Missing {
            name: official.to_string(),
            tried: format!("{} in {}", official_to_gguf(official).unwrap_or_default(), g.path().display()),
        })?;
        let found = &g.info(&name).unwrap().shape;
        if found != shape {
            return Err(LoadError::Shape { name, expected: shape.to_vec(), found: found.clone() });
        }
        Ok(name)
    }

    fn tensor(&mut self, official: &str, shape: &[usize]) -> Result<W, LoadError> {
        let (data, packed, bytes) = match self.src {
            Source::Safetensors(store) => {
                let name = self.resolve(store, official)?;
                self.read(store, &name, shape, Kind::Float)?
            }
            Source::Gguf(g) => {
                let name = self.gguf_resolve(g, official, shape)?;
                let info = g.info(&name).unwrap();
                let bytes = self.tick_bytes(info.n_bytes);
                let (data, packed) = if shape.len() == 2 {
                    self.gguf_rows(g, &name, 0, shape[0], shape[1])?
                } else if self.opts.dry {
                    (vec![], None)
                } else {
                    (g.f32(&name)?, None)
                };
                (data, packed, bytes)
            }
        };
        let part = self.opts.shard.part(self.cfg, official, shape);
        if part == Part::All {
            return self.put(official.to_string(), shape.to_vec(), data, packed, bytes);
        }
        let cut = packed.as_ref().and_then(|p| part.cut_packed(shape, p));
        let share =
            |b: u64| b * part.shape(shape).iter().product::<usize>() as u64 / shape.iter().product::<usize>() as u64;
        if cut.is_some() {
            return self.put(official.to_string(), part.shape(shape), vec![], cut, share(bytes));
        }
        // Blocks the cut does not fall on the boundaries of are handed over as f32.
        let mut t = HostTensor { name: official.to_string(), shape: shape.to_vec(), data, packed };
        if !self.opts.dry {
            t.dequantize();
        }
        let data = part.cut(shape, t.data);
        self.put(t.name, part.shape(shape), data, None, share(bytes))
    }

    /// The hash-routing table `[vocab, k]` of a hash layer.
    fn tid2eid(&mut self, official: &str, vocab: usize, k: usize) -> Result<Vec<i64>, LoadError> {
        let shape = [vocab, k];
        let (ids, bytes) = match self.src {
            Source::Safetensors(store) => {
                let name = self.resolve(store, official)?;
                let info = store.info(&name).unwrap();
                if info.shape != shape {
                    return Err(LoadError::Shape { name, expected: shape.to_vec(), found: info.shape.clone() });
                }
                let b = self.tick(store, &name);
                (store.i64(&name)?, b)
            }
            Source::Gguf(g) => {
                let name = self.gguf_resolve(g, official, &shape)?;
                let b = self.tick_bytes(g.info(&name).unwrap().n_bytes);
                (g.i32(&name)?.into_iter().map(i64::from).collect(), b)
            }
        };
        self.stats.add(official, bytes, (ids.len() * 4) as u64);
        Ok(ids)
    }

    fn hc(
        &mut self,
        fn_: &str,
        base: &str,
        scale: &str,
        rows: usize,
        width: usize,
        nscale: usize,
    ) -> Result<Hc<W>, LoadError> {
        Ok(Hc {
            fn_: self.tensor(fn_, &[rows, width])?,
            base: self.tensor(base, &[rows])?,
            scale: self.tensor(scale, &[nscale])?,
        })
    }

    fn compressor(
        &mut self,
        p: &str,
        width: usize,
        d: usize,
        ratio: usize,
        head: usize,
    ) -> Result<Compressor<W>, LoadError> {
        Ok(Compressor {
            wkv: self.tensor(&format!("{p}.wkv.weight"), &[width, d])?,
            wgate: self.tensor(&format!("{p}.wgate.weight"), &[width, d])?,
            ape: self.tensor(&format!("{p}.ape"), &[ratio, width])?,
            norm: self.tensor(&format!("{p}.norm.weight"), &[head])?,
        })
    }

    /// One routed expert.
    fn expert(&mut self, l: usize, e: usize, n_exp: usize, inter: usize, d: usize) -> Result<Expert<W>, LoadError> {
        match self.src {
            Source::Safetensors(store) => self.expert_st(store, l, e, n_exp, inter, d),
            Source::Gguf(g) => {
                let mut one = |w: &str, shape: [usize; 2]| -> Result<W, LoadError> {
                    let official = format!("layers.{l}.ffn.experts.{e}.{w}.weight");
                    let (name, _) = official_expert_to_gguf(&official).expect("an expert name");
                    let info = g.info(&name).ok_or_else(|| LoadError::Missing {
                        name: official.clone(),
                        tried: format!("{name} in {}", g.path().display()),
                    })?;
                    let stacked = vec![n_exp, shape[0], shape[1]];
                    if info.shape != stacked {
                        return Err(LoadError::Shape { name, expected: stacked, found: info.shape.clone() });
                    }
                    let bytes = self.tick_bytes(info.n_bytes / n_exp as u64);
                    let (data, packed) = self.gguf_rows(g, &name, e * shape[0], shape[0], shape[1])?;
                    self.put(official, shape.to_vec(), data, packed, bytes)
                };
                Ok(Expert { w1: one("w1", [inter, d])?, w3: one("w3", [inter, d])?, w2: one("w2", [d, inter])? })
            }
        }
    }

    /// One routed expert, from official per-expert tensors or HF's fused `[E, 2I, d]`/`[E, d, I]`.
    fn expert_st(
        &mut self,
        store: &TensorStore,
        l: usize,
        e: usize,
        n_exp: usize,
        inter: usize,
        d: usize,
    ) -> Result<Expert<W>, LoadError> {
        let prefix = if store.contains(&format!("model.layers.{l}.ffn.experts.{e}.w1.weight")) { "model." } else { "" };
        let off = |w: &str| format!("{prefix}layers.{l}.ffn.experts.{e}.{w}.weight");
        let fused_gu = format!("model.layers.{l}.mlp.experts.gate_up_proj");
        let fused_dn = format!("model.layers.{l}.mlp.experts.down_proj");
        let per_expert = store.contains(&off("w1"));
        if !per_expert && store.contains(&fused_gu) {
            let mut file_bytes = [0u64; 2];
            for (i, (n, shape)) in
                [(&fused_gu, vec![n_exp, 2 * inter, d]), (&fused_dn, vec![n_exp, d, inter])].into_iter().enumerate()
            {
                let info = store.info(n).ok_or_else(|| LoadError::Missing { name: n.clone(), tried: n.clone() })?;
                if info.shape != shape {
                    return Err(LoadError::Shape { name: n.clone(), expected: shape, found: info.shape.clone() });
                }
                if !info.dtype.is_float() {
                    return Err(LoadError::DType {
                        name: n.clone(),
                        expected: "a float type".into(),
                        found: info.dtype.name().into(),
                    });
                }
                file_bytes[i] = self.tick_bytes((info.numel() * info.dtype.size() / n_exp) as u64);
            }
            let (gu, dn) = if self.opts.dry {
                (vec![0f32; 0], vec![])
            } else {
                (
                    store.f32_range(&fused_gu, e * 2 * inter * d, 2 * inter * d)?,
                    store.f32_range(&fused_dn, e * d * inter, d * inter)?,
                )
            };
            let (g, u) = gu.split_at(gu.len() / 2);
            return Ok(Expert {
                w1: self.put(off("w1"), vec![inter, d], g.to_vec(), None, file_bytes[0] / 2)?,
                w3: self.put(off("w3"), vec![inter, d], u.to_vec(), None, file_bytes[0] / 2)?,
                w2: self.put(off("w2"), vec![d, inter], dn, None, file_bytes[1])?,
            });
        }
        let mut one = |w: &str, shape: [usize; 2]| -> Result<W, LoadError> {
            let name = off(w);
            if !store.contains(&name) {
                return Err(LoadError::Missing { name: name.clone(), tried: format!("{name}, {fused_gu}") });
            }
            let (data, packed, bytes) = self.read(store, &name, &shape, Kind::Expert)?;
            self.put(name, shape.to_vec(), data, packed, bytes)
        };
        Ok(Expert { w1: one("w1", [inter, d])?, w3: one("w3", [inter, d])?, w2: one("w2", [d, inter])? })
    }
}

/// Loads every tensor the config calls for. `upload` turns a dequantised host tensor into the
/// backend's handle (the CPU backend keeps it; a GPU backend copies it to device memory).
pub fn load_weights<W>(
    store: &TensorStore,
    cfg: &Config,
    progress: bool,
    upload: impl FnMut(HostTensor) -> Result<W, LoadError>,
) -> Result<Weights<W>, LoadError> {
    Ok(load_weights_from(Source::Safetensors(store), cfg, progress, upload)?.0)
}

/// [`load_weights`] from any [`Source`], with the bytes of each component.
pub fn load_weights_from<W>(
    src: Source<'_>,
    cfg: &Config,
    progress: bool,
    upload: impl FnMut(HostTensor) -> Result<W, LoadError>,
) -> Result<(Weights<W>, MemoryStats), LoadError> {
    load_weights_with(src, cfg, LoadOptions::default(), progress, upload)
}

/// [`load_weights_from`] with [`LoadOptions`] (packed weights, dry runs).
pub fn load_weights_with<W>(
    src: Source<'_>,
    cfg: &Config,
    opts: LoadOptions,
    progress: bool,
    upload: impl FnMut(HostTensor) -> Result<W, LoadError>,
) -> Result<(Weights<W>, MemoryStats), LoadError> {
    let total = src.total_bytes();
    let bar = (progress && !opts.dry && total > (256 << 20)).then(|| {
        let b = indicatif::ProgressBar::new(total);
        b.set_style(
            indicatif::ProgressStyle::with_template("loading weights {bar:40} {bytes}/{total_bytes} ({eta})")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    });
    opts.shard.check(cfg)?;
    let mut ld = Loader { src, cfg, layout: cfg.layout, upload, progress: bar, stats: MemoryStats::default(), opts };
    let (d, h, hd) = (cfg.hidden, cfg.n_heads, cfg.head_dim);
    let (hcw, mix, n) = (cfg.hc_width(), cfg.hc_mix(), cfg.hc_mult);
    let embed = ld.tensor("embed.weight", &[cfg.vocab_size, d])?;
    let mut layers = Vec::with_capacity(cfg.n_layers());
    for (l, spec) in cfg.layers.iter().enumerate() {
        let p = format!("layers.{l}");
        let hc_attn = ld.hc(
            &format!("{p}.hc_attn_fn"),
            &format!("{p}.hc_attn_base"),
            &format!("{p}.hc_attn_scale"),
            mix,
            hcw,
            3,
        )?;
        let hc_ffn =
            ld.hc(&format!("{p}.hc_ffn_fn"), &format!("{p}.hc_ffn_base"), &format!("{p}.hc_ffn_scale"), mix, hcw, 3)?;
        let attn_norm = ld.tensor(&format!("{p}.attn_norm.weight"), &[d])?;
        let ffn_norm = ld.tensor(&format!("{p}.ffn_norm.weight"), &[d])?;
        let a = format!("{p}.attn");
        let (compressor, indexer) = match spec.attn {
            AttnKind::Swa => (None, None),
            AttnKind::Hca => (Some(ld.compressor(&format!("{a}.compressor"), hd, d, spec.ratio, hd)?), None),
            AttnKind::Csa => {
                let c = ld.compressor(&format!("{a}.compressor"), 2 * hd, d, spec.ratio, hd)?;
                let (ih, id) = (cfg.index_n_heads, cfg.index_head_dim);
                let ix = Indexer {
                    wq_b: ld.tensor(&format!("{a}.indexer.wq_b.weight"), &[ih * id, cfg.q_lora_rank])?,
                    weights_proj: ld.tensor(&format!("{a}.indexer.weights_proj.weight"), &[ih, d])?,
                    compressor: ld.compressor(&format!("{a}.indexer.compressor"), 2 * id, d, spec.ratio, id)?,
                };
                (Some(c), Some(ix))
            }
        };
        let attn = Attention {
            wq_a: ld.tensor(&format!("{a}.wq_a.weight"), &[cfg.q_lora_rank, d])?,
            q_norm: ld.tensor(&format!("{a}.q_norm.weight"), &[cfg.q_lora_rank])?,
            wq_b: ld.tensor(&format!("{a}.wq_b.weight"), &[h * hd, cfg.q_lora_rank])?,
            wkv: ld.tensor(&format!("{a}.wkv.weight"), &[hd, d])?,
            kv_norm: ld.tensor(&format!("{a}.kv_norm.weight"), &[hd])?,
            wo_a: ld.tensor(&format!("{a}.wo_a.weight"), &[cfg.o_groups * cfg.o_lora_rank, h * hd / cfg.o_groups])?,
            wo_b: ld.tensor(&format!("{a}.wo_b.weight"), &[d, cfg.o_groups * cfg.o_lora_rank])?,
            sinks: ld.tensor(&format!("{a}.attn_sink"), &[h])?,
            compressor,
            indexer,
        };
        let f = format!("{p}.ffn");
        let (ne, k, inter) = (cfg.n_routed_experts, cfg.n_experts_per_tok, cfg.moe_inter);
        let gate = ld.tensor(&format!("{f}.gate.weight"), &[ne, d])?;
        let (bias, tid2eid) = if spec.hash_moe {
            let official = format!("{f}.gate.tid2eid");
            let ids = ld.tid2eid(&official, cfg.vocab_size, k)?;
            check_tid2eid(&official, &ids, k, ne)?;
            (None, Some(ids.into_iter().map(|x| x as u32).collect()))
        } else {
            (Some(ld.tensor(&format!("{f}.gate.bias"), &[ne])?), None)
        };
        let owned = opts.shard.experts(cfg);
        let experts = owned.clone().map(|e| ld.expert(l, e, ne, inter, d)).collect::<Result<Vec<_>, _>>()?;
        let s = format!("{f}.shared_experts");
        let shared = Expert {
            w1: ld.tensor(&format!("{s}.w1.weight"), &[inter, d])?,
            w2: ld.tensor(&format!("{s}.w2.weight"), &[d, inter])?,
            w3: ld.tensor(&format!("{s}.w3.weight"), &[inter, d])?,
        };
        layers.push(Layer {
            attn_norm,
            ffn_norm,
            hc_attn,
            hc_ffn,
            attn,
            ffn: Moe { gate, bias, tid2eid, experts, expert0: owned.start, shared },
        });
    }
    let norm = ld.tensor("norm.weight", &[d])?;
    let hc_head = ld.hc("hc_head_fn", "hc_head_base", "hc_head_scale", n, hcw, 1)?;
    let head = ld.tensor("head.weight", &[cfg.vocab_size, d])?;
    if let Some(p) = &ld.progress {
        p.finish_and_clear();
    }
    Ok((Weights { embed, head, norm, hc_head, layers }, ld.stats))
}

/// A hash layer's routing table as the spec has it (§12.2): each token's row holds `k` distinct
/// expert ids in `0..ne`. An id outside would index past the experts; with a repeated one the
/// CUDA backend's one-row expert paths disagree (the two-launch kernels sum slot by slot; the
/// separate one-row kernels, `moe_up1x` / `moe_down1x`, take one pair an active expert: PERF.md
/// v44). Both are refused at load, naming the token and slot.
pub(crate) fn check_tid2eid(name: &str, ids: &[i64], k: usize, ne: usize) -> Result<(), LoadError> {
    for (t, row) in ids.chunks(k.max(1)).enumerate() {
        for (j, &x) in row.iter().enumerate() {
            if x < 0 || x as usize >= ne {
                return Err(LoadError::Value {
                    name: name.into(),
                    msg: format!("token {t}, slot {j} (entry {}) is expert {x}, outside 0..{ne}", t * k + j),
                });
            }
            if row[..j].contains(&x) {
                return Err(LoadError::Value {
                    name: name.into(),
                    msg: format!("token {t} routes to expert {x} twice (slot {j}); a row's {k} experts must differ"),
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{check_tid2eid, hf_name};

    #[test]
    fn official_to_hf_names() {
        let cases = [
            ("embed.weight", "model.embed_tokens.weight"),
            ("head.weight", "lm_head.weight"),
            ("hc_head_fn", "model.hc_head.hc_fn"),
            ("layers.2.attn.compressor.wkv.weight", "model.layers.2.self_attn.compressor.kv_proj.weight"),
            ("layers.2.attn.indexer.compressor.ape", "model.layers.2.self_attn.compressor.indexer.position_bias"),
            (
                "layers.2.attn.indexer.weights_proj.weight",
                "model.layers.2.self_attn.compressor.indexer.scorer.weights_proj.weight",
            ),
            ("layers.3.ffn.gate.bias", "model.layers.3.mlp.gate.e_score_correction_bias"),
            ("layers.0.ffn.gate.tid2eid", "model.layers.0.mlp.gate.tid2eid"),
            ("layers.0.hc_ffn_base", "model.layers.0.ffn_hc.base"),
            ("layers.1.attn.attn_sink", "model.layers.1.self_attn.sinks"),
            ("layers.1.ffn.shared_experts.w2.weight", "model.layers.1.mlp.shared_experts.down_proj.weight"),
            ("layers.1.attn_norm.weight", "model.layers.1.input_layernorm.weight"),
        ];
        for (o, h) in cases {
            assert_eq!(hf_name(o), h, "{o}");
        }
    }

    #[test]
    fn tid2eid_rows_must_hold_distinct_experts_in_range() {
        assert!(check_tid2eid("t", &[0, 1, 2, 3, 2, 1], 3, 4).is_ok());
        let e = check_tid2eid("t", &[0, 1, 2, 3, 1, 3], 3, 4).unwrap_err().to_string();
        assert!(e.contains("token 1 routes to expert 3 twice (slot 2)"), "{e}");
        let e = check_tid2eid("t", &[0, 1, 4], 3, 4).unwrap_err().to_string();
        assert!(e.contains("token 0, slot 2 (entry 2) is expert 4, outside 0..4"), "{e}");
        let e = check_tid2eid("t", &[0, -1, 2], 3, 4).unwrap_err().to_string();
        assert!(e.contains("is expert -1"), "{e}");
    }
}
