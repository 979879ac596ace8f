//! The CUDA backend (feature `cuda`): every op of [`Backend`] on one NVIDIA GPU, f32 throughout.
//!
//! Weights live on the device in f32; dense products go through cuBLAS SGEMM (true f32, no
//! TF32); everything else is small CUDA C kernels in `kernels/*.cu`, compiled at start by NVRTC
//! for `compute_90a` (JIT-compiled by the driver to sm_90a) with `--fmad=false`, so that each
//! kernel rounds like the CPU oracle it replaces. All work is queued on one stream; nothing
//! synchronises except [`Backend::to_host`]. Per-sequence state lives on the device
//! ([`state::CudaCache`]).
//!
//! Layout: this file holds the backend, the row table and the dense ops (`dense.cu`, `hc.cu`);
//! [`attention`] the compressor, indexer and attention (`attention.cu`); [`moe`] the router and
//! experts (`moe.cu`).

pub mod attention;
pub mod bf16;
pub mod chain;
pub mod draw;
pub mod dspark;
pub mod gemm;
pub mod graph;
pub(crate) mod launch;
pub mod moe;
pub mod nccl;
pub mod quant;
pub mod state;

use crate::backend::{Backend, CompSlot, NormJob};
use crate::batch::Batch;
use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PinnedHostSlice,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use dsv4_model::weights::{Compressor, Expert, Hc};
use dsv4_model::{Config, HostTensor, LoadError};
use launch::Kernel;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Timing events (see [`CudaBackend::timing_event`]).
pub type TimingEvent = CudaEvent;
pub use state::CudaCache;

/// A row-major f32 matrix on the device (1-D weights are one row).
pub struct CudaTensor {
    pub rows: usize,
    pub cols: usize,
    pub data: CudaSlice<f32>,
    /// The int8 codes and block scales of `data` ([`crate::x8`]), where a producer wrote them
    /// beside it (the RMSNorms) or a product quantised it: the products after it then skip
    /// their `quant_x8`. Every in-place writer goes through [`CudaTensor::data_mut`], which
    /// drops them.
    pub(crate) x8: std::sync::OnceLock<X8Twin>,
    /// The values rounded to bf16 (`cast_bf16`), made by the first tensor-core product that
    /// needs them: the attention input feeds up to seven products, each of which cast it
    /// again. Dropped by [`CudaTensor::data_mut`] as `x8` is.
    pub(crate) bf: std::sync::OnceLock<CudaSlice<u16>>,
    /// The next HC_PRE's partial sums over these streams (`hc_pre_dot`'s layout), formed beside
    /// them by `hc_post_dot`, with the address of the `fn` weight they were formed with. Dropped
    /// by [`CudaTensor::data_mut`] as `x8` is.
    pub(crate) hc_part: std::sync::OnceLock<(u64, CudaSlice<f32>)>,
}

/// `quant_x8` of a tensor's values (see [`CudaTensor::x8`]).
pub(crate) struct X8Twin {
    pub q: CudaSlice<i8>,
    pub d: CudaSlice<f32>,
}

impl CudaTensor {
    pub fn new(rows: usize, cols: usize, data: CudaSlice<f32>) -> Self {
        CudaTensor {
            rows,
            cols,
            data,
            x8: std::sync::OnceLock::new(),
            bf: std::sync::OnceLock::new(),
            hc_part: std::sync::OnceLock::new(),
        }
    }

    /// The values, to be written in place: drops the int8 twin, the bf16 copy and the kept
    /// HC_PRE sums.
    pub(crate) fn data_mut(&mut self) -> &mut CudaSlice<f32> {
        self.x8 = std::sync::OnceLock::new();
        self.bf = std::sync::OnceLock::new();
        self.hc_part = std::sync::OnceLock::new();
        &mut self.data
    }

    /// Whether the next HC_PRE's sums were formed beside these streams
    /// ([`CudaBackend::set_hc_post_dot`]).
    pub fn carries_hc_sums(&self) -> bool {
        self.hc_part.get().is_some()
    }
}

/// A weight on the device: f32 (`data`); bf16 (`bf`, with `data` a one-element placeholder)
/// for the matrices [`crate::bf16::is_bf16_weight`] selects when the backend stores bf16; or
/// packed blocks (`q`, see [`quant`]) for such matrices loaded from FP8/FP4/GGUF blocks.
pub struct CudaWeight {
    pub rows: usize,
    pub cols: usize,
    pub data: CudaSlice<f32>,
    pub bf: Option<CudaSlice<u16>>,
    pub q: Option<quant::QuantDev>,
}

impl CudaWeight {
    /// Device bytes the weight holds.
    pub fn bytes(&self) -> usize {
        match (&self.bf, &self.q) {
            (_, Some(q)) => q.bytes(),
            (Some(bf), None) => bf.len() * 2,
            (None, None) => self.data.len() * 4,
        }
    }
}

/// The batch's row table on the device: six `u32` arrays of `n` (sequence, position, token,
/// segment start, segment first position, segment length), plus the host batch for host-side
/// bookkeeping (state growth).
pub struct CudaRows {
    pub batch: Batch,
    /// Fresh for an eager forward; a recorded step's persistent input buffer ([`graph::StepIo`]).
    dev: Arc<CudaSlice<u32>>,
}

impl CudaRows {
    pub fn len(&self) -> usize {
        self.batch.len()
    }
    pub fn is_empty(&self) -> bool {
        self.batch.is_empty()
    }
}

/// Token ids on the device ([`Backend::Ids`]): the first `n` of `dev` (an upload's buffer may be
/// longer).
pub struct CudaIds {
    dev: CudaSlice<u32>,
    n: usize,
}

/// Indexer selection: `[rows, topk]` entry ids; row `t` uses the first `min(topk, visible)`.
pub struct CudaSel {
    pub topk: usize,
    pub idx: CudaSlice<u32>,
}

/// Expert ids and weights, `[rows, k]` each.
pub struct CudaRoute {
    pub k: usize,
    /// Experts the router chose from (all of them, whatever share a rank holds).
    pub experts: usize,
    pub ids: CudaSlice<u32>,
    pub weights: CudaSlice<f32>,
}

/// Why the backend could not start.
#[derive(Debug, thiserror::Error)]
pub enum CudaInitError {
    #[error("no CUDA driver library could be loaded")]
    NoDriver,
    #[error("the {0} library could not be loaded")]
    NoLibrary(&'static str),
    #[error("no CUDA device")]
    NoDevice,
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("cuBLAS: {0}")]
    Blas(#[from] cudarc::cublas::result::CublasError),
    #[error("NVRTC compiling {file}: {msg}")]
    Compile { file: &'static str, msg: String },
    #[error("no kernel cache folder: DSV4_KERNEL_CACHE is 0 or empty, or neither XDG_CACHE_HOME nor HOME is set, or NVRTC gave no version")]
    NoCache,
    #[error("{0}'s PTX was compiled but could not be kept in the kernel cache (see the warning before)")]
    NotKept(&'static str),
}

/// A pinned host buffer for stream-ordered uploads; `done` is recorded after the copy that
/// read it, and the buffer is written again only once that event has completed.
struct Staging {
    buf: PinnedHostSlice<u32>,
    done: CudaEvent,
}

/// The kernels, one field per `extern "C"` function.
pub(crate) struct Kernels {
    pub gather_rows: CudaFunction,
    pub add: CudaFunction,
    pub copy_blocks: CudaFunction,
    pub side_delay: CudaFunction,
    pub chain_link: CudaFunction,
    pub chain_barrier: CudaFunction,
    pub gather_regions: CudaFunction,
    pub hc_expand: CudaFunction,
    pub stream_mean: CudaFunction,
    pub swiglu_act: CudaFunction,
    pub rms_norm: CudaFunction,
    pub rms_norm_warp: CudaFunction,
    pub rope: CudaFunction,
    pub rope_cast: CudaFunction,
    pub gemv_f32: CudaFunction,
    pub norm_many: CudaFunction,
    pub gemv_route: CudaFunction,
    pub hc_pre_dot: CudaFunction,
    pub hc_pre_dot_rows: CudaFunction,
    pub hc_pre_dot_tc: CudaFunction,
    pub hc_pre_apply: CudaFunction,
    pub hc_pre_apply_norm: CudaFunction,
    pub hc_pre_sink_rows: CudaFunction,
    pub hc_post4: CudaFunction,
    pub hc_post: CudaFunction,
    pub hc_post_dot: CudaFunction,
    pub hc_head: CudaFunction,
    pub comp_pool: CudaFunction,
    pub comp_store: CudaFunction,
    pub comp_pool_store: CudaFunction,
    pub index_score: CudaFunction,
    pub index_score_tc: CudaFunction,
    pub index_topk: CudaFunction,
    pub index_score_topk: CudaFunction,
    pub attention: CudaFunction,
    pub attention_tc: CudaFunction,
    pub attention_tcd: CudaFunction,
    pub attention_merge: CudaFunction,
    pub ring_write: CudaFunction,
    pub route: CudaFunction,
    pub moe_up: CudaFunction,
    pub moe_down: CudaFunction,
    pub moe_combine: CudaFunction,
    pub gemv_bf16: CudaFunction,
    pub gemv1_bf16: CudaFunction,
    pub gemvt_bf16: CudaFunction,
    /// `gemvt_bf16`'s bits with one k block in flight a warp (more than 8 rows).
    pub gemvt16_bf16: CudaFunction,
    /// `gemvt_bf16`'s bits, software-pipelined (`DSV4_GEMVT_PIPE=1`, bf16.rs `gemvt_pipe`).
    pub gemvtp_bf16: CudaFunction,
    /// A step's token per output row (`draw.cu`).
    pub draw_rows: CudaFunction,
    pub cast_bf16: CudaFunction,
    pub moe_sort: CudaFunction,
    pub moe_gather_bf16: CudaFunction,
    pub swiglu_bf16: CudaFunction,
    pub moe_combine_sorted: CudaFunction,
    pub probe_finite: CudaFunction,
    pub rand_normal: CudaFunction,
}

const COMMON: &str = include_str!("kernels/common.cuh");

/// common.cuh as every kernel file is compiled with: the built-in one, or a
/// `DSV4_CUDA_KERNELS` variant's ([`kernel_source`]).
fn common() -> std::borrow::Cow<'static, str> {
    kernel_source("common.cuh", COMMON)
}

/// Rows from which a fast-mode HC_PRE takes `hc_pre_dot_rows` (prefill chunks).
const HC_DOT_ROWS_MIN: usize = 256;

/// `HC_SPLIT` and `HC_ROWS` of hc.cu: column slices of HC_PRE's partial sums, and rows a
/// `hc_pre_dot` block takes.
const HC_SPLIT: usize = 32;
const HC_ROWS: usize = 4;

/// `hc_pre_dot`'s grid (and `hc_post_dot`'s, which forms the same sums): slices × groups of 8
/// outputs × groups of HC_ROWS rows, 256 threads a block.
fn hc_dot_grid(rows: usize, mix: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (HC_SPLIT as u32, (mix + 1).div_ceil(8) as u32, rows.div_ceil(HC_ROWS) as u32),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// HC_PRE's partial sums `[rows, HC_SPLIT, mix + 1]`: formed by this call, or kept on the
/// streams by the HC_POST that wrote them.
enum HcPart<'a> {
    Formed(CudaSlice<f32>),
    Kept(&'a CudaSlice<f32>),
}

impl std::ops::Deref for HcPart<'_> {
    type Target = CudaSlice<f32>;
    fn deref(&self) -> &CudaSlice<f32> {
        match self {
            HcPart::Formed(p) => p,
            HcPart::Kept(p) => p,
        }
    }
}

/// A timing probe (PERF.md v25, lever 2): `DSV4_PROBE_HC_TWICE=1` launches `hc_pre_apply_norm`
/// twice in a row (it reads nothing it writes, so the values are unchanged), so that a step's
/// ncu profile shows the launch cold and again with its code and data just used: a cold
/// instruction cache would show as a much shorter second launch.
fn probe_hc_twice() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("DSV4_PROBE_HC_TWICE").is_ok_and(|v| v.trim() == "1"))
}

/// Whether prefill-sized HC_PRE sums run on tensor cores (`hc_pre_dot_tc`; `DSV4_HC_DOT_TC=0`:
/// `hc_pre_dot_rows`, the A/B switch).
fn hc_dot_tc() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("DSV4_HC_DOT_TC").map(|v| v != "0").unwrap_or(true))
}

/// The decode fusions (v22, v23 in PERF.md), all bitwise the launches they replace: each one's
/// own variable (`=1` on, `=0` off) wins, else `DSV4_DECODE_FUSIONS` (`=1` all on, `=0` all
/// off), else the default: on, except [`HC_POST_DOT_DEFAULT`]'s (measured on the H200, v24).
fn decode_fusion(name: &str) -> bool {
    decode_fusion_in(name, |n| std::env::var(n).ok())
}

/// `DSV4_HC_POST_DOT`'s default: off. On 43 q2 layers at context 4096 it made the batch-16 step
/// 36.5 → 38.3 ms and moved batch 1 by less than the spread (v24).
const HC_POST_DOT_DEFAULT: bool = false;

/// [`decode_fusion`] over the variables `var` gives.
fn decode_fusion_in(name: &str, var: impl Fn(&str) -> Option<String>) -> bool {
    let flag = |n: &str| match var(n).as_deref().map(str::trim) {
        Some("1") => Some(true),
        Some("0") => Some(false),
        _ => None,
    };
    let default = name != "DSV4_HC_POST_DOT" || HC_POST_DOT_DEFAULT;
    flag(name).or_else(|| flag("DSV4_DECODE_FUSIONS")).unwrap_or(default)
}

/// Groups from which an RMSNorm of 512-value groups takes `rms_norm_warp` (bitwise `rms_norm`'s
/// values; a prefill chunk's q heads).
const NORM_WARP_GROUPS: usize = 4096;

/// Rows up to which [`crate::Backend::norms`] takes `norm_many` (decode and verify batches).
const NORM_GROUP_ROWS: usize = 128;

/// `NormJob` of dense.cu: one job of a `norm_many` launch (an RMSNorm where `nt > 0`, else a
/// RoPE in place on `out`).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct NormJobDev {
    out: u64,
    xq: u64,
    xd: u64,
    x: u64,
    w: u64,
    eps: f32,
    has_w: i32,
    group: i32,
    twin: i32,
    heads: i32,
    npairs: i32,
    nt: i32,
    cols: i32,
    head: i32,
    b0: i32,
}

/// `NormJobs` of dense.cu (`NJ_MAX` = 2 jobs), passed by value.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct NormJobsDev {
    j: [NormJobDev; 2],
    count: i32,
    blocks: i32,
}

// SAFETY: #[repr(C)] in dense.cu's field order: 5 pointers, then 10 4-byte fields (80 bytes a
// job, no padding), two jobs and two ints (168 bytes), as the kernel declares it.
unsafe impl launch::KernelStruct for NormJobsDev {}
const _: () = assert!(std::mem::size_of::<NormJobsDev>() == 168);

/// Keeps freed device memory in the device's stream-ordered pool (where `alloc` takes it) across
/// synchronisations: at the default release threshold of 0 the driver hands it back to the OS
/// at every sync, so each prefill chunk mapped its gigabytes of temporaries again, on the host,
/// inside the forward (`DSV4_PROFILE_PREFILL`: ~1 ms of host time a layer in the q stage of an
/// 8K-token chunk). `DSV4_POOL_KEEP=0` leaves the driver's default (the A/B switch).
fn keep_pool_memory(ordinal: usize) {
    use cudarc::driver::sys;
    if std::env::var("DSV4_POOL_KEEP").is_ok_and(|v| v == "0") {
        return;
    }
    let ok = sys::CUresult::CUDA_SUCCESS;
    // SAFETY: plain driver queries and one pool attribute on a device the caller's context was
    // just created on; the out-pointers are valid locals and the value a u64, as the attribute
    // takes.
    unsafe {
        let mut dev: sys::CUdevice = 0;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        if sys::cuDeviceGet(&mut dev, ordinal as i32) != ok || sys::cuDeviceGetDefaultMemPool(&mut pool, dev) != ok {
            tracing::warn!("no default memory pool: freed memory returns to the OS at each sync");
            return;
        }
        let mut keep = u64::MAX;
        let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
        if sys::cuMemPoolSetAttribute(pool, attr, &mut keep as *mut u64 as *mut std::ffi::c_void) != ok {
            tracing::warn!("could not set the memory pool's release threshold");
        }
    }
}

/// Compiles every kernel file with NVRTC (no device needed); the PTX is kept for later backends.
pub fn compile_kernels() -> Result<(), CudaInitError> {
    // SAFETY: only tries to dlopen the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaInitError::NoLibrary("NVRTC"));
    }
    // Always NVRTC's own compile, never a kept PTX (`DSV4_KERNEL_CACHE`): this is the check
    // that the sources compile.
    for (file, src) in SOURCES {
        ptx_from(file, src, false)?;
    }
    ptx_from("quant.cu", &quant::source(), false)?;
    ptx_from(dspark::SOURCE.0, dspark::SOURCE.1, false)?;
    Ok(())
}

/// Compiles every kernel file as a backend here would load it (the `DSV4_CUDA_KERNELS` variant
/// and the launcher's macros from the environment) into the kernel cache (`DSV4_KERNEL_CACHE`),
/// with no device: a machine whose NVRTC has the same version then loads the PTX instead of
/// compiling it (~35 s a process; ~70 s for each quant.cu variant). Returns the files compiled.
pub fn keep_kernels() -> Result<Vec<&'static str>, CudaInitError> {
    // SAFETY: only tries to dlopen the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaInitError::NoLibrary("NVRTC"));
    }
    if ptx_cache_path("probe", "", "", false).is_none() {
        return Err(CudaInitError::NoCache);
    }
    let keep = |file: &'static str, src: &str| -> Result<&'static str, CudaInitError> {
        ptx(file, src)?;
        let kept =
            ptx_cache_path(file, &format!("{}\n{src}", common()), ARCH, fmad_of(file)).is_some_and(|p| p.is_file());
        if kept {
            Ok(file)
        } else {
            Err(CudaInitError::NotKept(file))
        }
    };
    let mut done = Vec::new();
    for (file, src) in SOURCES {
        done.push(keep(file, &kernel_source(file, src))?);
    }
    done.push(keep("quant.cu", &quant::source())?);
    done.push(keep(dspark::SOURCE.0, dspark::SOURCE.1)?);
    Ok(done)
}

const SOURCES: [(&str, &str); 6] = [
    ("dense.cu", include_str!("kernels/dense.cu")),
    ("hc.cu", include_str!("kernels/hc.cu")),
    ("attention.cu", include_str!("kernels/attention.cu")),
    ("moe.cu", include_str!("kernels/moe.cu")),
    ("bf16.cu", include_str!("kernels/bf16.cu")),
    ("draw.cu", include_str!("kernels/draw.cu")),
];

/// PTX of each kernel file, compiled once per process (later backends only load it).
static PTX: Mutex<Vec<(&'static str, cudarc::nvrtc::Ptx)>> = Mutex::new(Vec::new());

/// A kernel file's source: the built-in one, or `$DSV4_CUDA_KERNELS/<file>` where that is set
/// and holds the file — kernel variants timed on the device, which has no Rust toolchain,
/// without rebuilding (their launch signatures must match the built-in ones).
pub(crate) fn kernel_source(file: &str, builtin: &'static str) -> std::borrow::Cow<'static, str> {
    let Some(dir) = std::env::var_os("DSV4_CUDA_KERNELS") else { return builtin.into() };
    match std::fs::read_to_string(std::path::Path::new(&dir).join(file)) {
        Ok(s) => {
            tracing::warn!(
                "{file}: using {} instead of the built-in kernels",
                std::path::Path::new(&dir).join(file).display()
            );
            s.into()
        }
        Err(_) => builtin.into(),
    }
}

fn ptx(file: &'static str, src: &str) -> Result<cudarc::nvrtc::Ptx, CudaInitError> {
    ptx_from(file, src, true)
}

/// The kernels' virtual architecture (NVRTC's `--gpu-architecture`).
const ARCH: &str = "compute_90a";

/// FMA contraction of a kernel file: bf16.cu and quant.cu are not f32 oracle twins, so their
/// dot products contract.
fn fmad_of(file: &str) -> bool {
    file == "bf16.cu" || file == "quant.cu"
}

/// Where the machine code of a kept PTX is kept (`tools/device/keep_ptx.sh` assembles each kept
/// PTX for sm_90a with the ptxas of the device's CUDA version): beside the PTX, the same name.
fn cubin_path(ptx: &std::path::Path) -> std::path::PathBuf {
    ptx.with_extension("sm_90a.cubin")
}

/// Loads kernel file `file` (source `src`) into `ctx`: its kept sm_90a cubin where there is one
/// and the device takes it, else its PTX, which the driver compiles at load (~20–40 s a process
/// for the kernel files on a device whose driver has not cached them: most of a device call's
/// process start once the PTX is kept).
pub(crate) fn load_kernel_module(
    ctx: &Arc<CudaContext>,
    file: &'static str,
    src: &str,
) -> Result<Arc<cudarc::driver::CudaModule>, CudaInitError> {
    let full = format!("{}\n{src}", common());
    let path = ptx_cache_path(file, &full, ARCH, fmad_of(file));
    let kept = path.as_ref().and_then(|p| Some((p, cubin_path(p), std::fs::read(cubin_path(p)).ok()?)));
    if let Some((p, c, bin)) = kept {
        // The driver reads a module image with no length (`cuModuleLoadData`): a cut-off
        // file would be read past its end, so only a whole ELF goes to it.
        if !elf_is_whole(&bin) {
            tracing::warn!("{file}: {} is not a whole ELF image; loading its PTX", c.display());
        } else {
            match ctx.load_module(cudarc::nvrtc::Ptx::from_binary(bin)) {
                Ok(m) => {
                    touch(p);
                    return Ok(m);
                }
                Err(e) => tracing::warn!("{file}: its kept cubin did not load ({e}); loading its PTX"),
            }
        }
    }
    Ok(ctx.load_module(ptx(file, src)?)?)
}

/// Whether `bin` is a whole 64-bit little-endian ELF image: its program and section header
/// tables and every section with contents lie inside it.
fn elf_is_whole(bin: &[u8]) -> bool {
    let u16_at = |o: usize| bin.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]) as u64);
    let u32_at = |o: usize| bin.get(o..o + 4).map(|b| u32::from_le_bytes(b.try_into().unwrap()));
    let u64_at = |o: usize| bin.get(o..o + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap()));
    let inside = |off: u64, n: u64, each: u64| {
        n.checked_mul(each).and_then(|len| off.checked_add(len)).is_some_and(|end| end <= bin.len() as u64)
    };
    if bin.len() < 64 || bin[..4] != *b"\x7fELF" || bin[4] != 2 || bin[5] != 1 {
        return false;
    }
    let (Some(phoff), Some(shoff)) = (u64_at(0x20), u64_at(0x28)) else { return false };
    let (Some(phsize), Some(phnum), Some(shsize), Some(shnum)) =
        (u16_at(0x36), u16_at(0x38), u16_at(0x3A), u16_at(0x3C))
    else {
        return false;
    };
    if !inside(phoff, phnum, phsize) || !inside(shoff, shnum, shsize) || (shnum > 0 && shsize < 0x28) {
        return false;
    }
    // Each section header: sh_type at +4, sh_offset at +0x18, sh_size at +0x20; SHT_NOBITS (8)
    // takes no bytes of the file.
    (0..shnum).all(|i| {
        let h = (shoff + i * shsize) as usize;
        match (u32_at(h + 4), u64_at(h + 0x18), u64_at(h + 0x20)) {
            (Some(8), _, _) => true,
            (Some(_), Some(off), Some(size)) => inside(off, size, 1),
            _ => false,
        }
    })
}

/// Marks a kept PTX as just used, so that [`prune_ptx`] (newest first) keeps what a device
/// call still loads rather than what was compiled last.
fn touch(path: &std::path::Path) {
    let _ = std::fs::File::options().append(true).open(path).and_then(|f| f.set_modified(std::time::SystemTime::now()));
}

/// [`ptx`], reading and keeping the PTX in the kernel cache's folder when `disk`.
fn ptx_from(file: &'static str, src: &str, disk: bool) -> Result<cudarc::nvrtc::Ptx, CudaInitError> {
    let mut cache = PTX.lock().unwrap();
    if let Some((_, p)) = cache.iter().find(|(f, _)| *f == file).filter(|_| disk) {
        return Ok(p.clone());
    }
    let fmad = fmad_of(file);
    let full = format!("{}\n{src}", common());
    let disk = if disk { ptx_cache_path(file, &full, ARCH, fmad) } else { None };
    if let Some((d, text)) = disk.as_ref().and_then(|d| Some((d, std::fs::read_to_string(d).ok()?))) {
        touch(d);
        let p = cudarc::nvrtc::Ptx::from_src(text);
        cache.push((file, p.clone()));
        return Ok(p);
    }
    let opts = CompileOptions {
        arch: Some(ARCH),
        fmad: Some(fmad),
        name: Some(file.into()),
        options: vec!["--std=c++17".into()],
        ..Default::default()
    };
    let p = compile_ptx_with_opts(full, opts).map_err(|e| CudaInitError::Compile { file, msg: e.to_string() })?;
    if let Some(d) = disk {
        store_ptx(&d, &p.to_src());
        prune_ptx(&d, file, PTX_KEEP);
    }
    cache.push((file, p.clone()));
    Ok(p)
}

/// Where a kernel file's PTX is kept between processes: NVRTC takes ~35 s for the kernel files
/// (quant.cu's templates most of it), every process start, where reading a kept PTX takes
/// milliseconds (a device call that runs several processes, a server's restart). The folder is
/// `DSV4_KERNEL_CACHE` (`0` or empty: none), else `$XDG_CACHE_HOME/dsv4/ptx` or
/// `$HOME/.cache/dsv4/ptx`. The name hashes everything the PTX depends on: the file's name and
/// the source NVRTC compiles (so an edited kernel or a `DSV4_CUDA_KERNELS` variant compiles
/// afresh), the options, and NVRTC's version (a newer NVRTC's PTX may not load on an older
/// driver).
fn ptx_cache_path(file: &str, src: &str, arch: &str, fmad: bool) -> Option<std::path::PathBuf> {
    let dir = match std::env::var_os("DSV4_KERNEL_CACHE") {
        Some(d) if d.is_empty() || d == "0" => return None,
        Some(d) => std::path::PathBuf::from(d),
        None => std::env::var_os("XDG_CACHE_HOME")
            .filter(|d| !d.is_empty())
            .map(std::path::PathBuf::from)
            .or_else(|| {
                std::env::var_os("HOME").filter(|d| !d.is_empty()).map(|h| std::path::Path::new(&h).join(".cache"))
            })?
            .join("dsv4")
            .join("ptx"),
    };
    let (mut major, mut minor) = (0, 0);
    // SAFETY: `is_culib_present` only tries to dlopen NVRTC (without it, cudarc's loader would
    // panic at the first call); nvrtcVersion writes two ints through valid pointers.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return None;
    }
    // SAFETY: as above; NVRTC is present.
    let ok = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
        == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS;
    if !ok {
        return None;
    }
    let key = ptx_key(&[
        file.as_bytes(),
        src.as_bytes(),
        arch.as_bytes(),
        &[fmad as u8],
        &major.to_le_bytes(),
        &minor.to_le_bytes(),
    ]);
    Some(dir.join(format!("{file}-{key:032x}.ptx")))
}

/// FNV-1a (128-bit) over the parts, each followed by its length: stable across builds and
/// Rust versions, unlike `DefaultHasher`.
fn ptx_key(parts: &[&[u8]]) -> u128 {
    const PRIME: u128 = 0x0000000001000000000000000000013B;
    let mut h: u128 = 0x6c62272e07bb014262b821756295c58d;
    for p in parts {
        for &b in p.iter().chain((p.len() as u64).to_le_bytes().iter()) {
            h ^= b as u128;
            h = h.wrapping_mul(PRIME);
        }
    }
    h
}

/// PTX files kept for each kernel file (the most recently used; an edited kernel or a variant
/// adds one, quant.cu's is ~13 MB). A device call's A/B can load 16 quant.cu forms, so 24
/// leaves room for a compile miss without evicting one it still loads.
const PTX_KEEP: usize = 24;

/// Removes all but the `keep` newest kept PTX files of kernel file `file` beside `path`.
fn prune_ptx(path: &std::path::Path, file: &str, keep: usize) {
    let Some(dir) = path.parent() else { return };
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let prefix = format!("{file}-");
    let mut kept: Vec<(std::time::SystemTime, std::path::PathBuf)> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_str().is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".ptx")))
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    kept.sort_by_key(|k| std::cmp::Reverse(k.0));
    for (_, old) in kept.into_iter().skip(keep) {
        let _ = std::fs::remove_file(cubin_path(&old));
        let _ = std::fs::remove_file(old);
    }
}

/// Writes `text` to `path` whole or not at all (a temporary file renamed into place, so a
/// concurrent process never reads a part); a folder that cannot be written only costs the
/// next process its compile.
fn store_ptx(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let r = path
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|_| std::fs::write(&tmp, text))
        .and_then(|_| std::fs::rename(&tmp, path));
    if let Err(e) = r {
        let _ = std::fs::remove_file(&tmp);
        tracing::warn!("kernel cache: could not keep {}: {e}", path.display());
    }
}

fn compile(ctx: &Arc<CudaContext>, idx: usize, names: &[&str]) -> Result<Vec<CudaFunction>, CudaInitError> {
    let (file, src) = SOURCES[idx];
    let module = load_kernel_module(ctx, file, &kernel_source(file, src))?;
    names.iter().map(|n| load_function(&module, n)).collect()
}

/// A kernel of a loaded module, with the shared-memory carveout `DSV4_SMEM_CARVEOUT` asks of
/// every kernel (a percentage of the SM's most shared memory, 0 to 100; unset: the driver's
/// choice for each launch). An SM's split between L1 and shared memory is set per launch, and
/// kernels that need more shared memory than the one before (quant.cu's staged experts, ~120 KB
/// an SM) make it change and leave the L1 smaller for the kernels after them; one split for all
/// measures what that costs (PERF.md v52).
pub(crate) fn load_function(
    module: &Arc<cudarc::driver::CudaModule>,
    name: &str,
) -> Result<CudaFunction, CudaInitError> {
    static CARVEOUT: std::sync::OnceLock<Option<i32>> = std::sync::OnceLock::new();
    let f = module.load_function(name)?;
    let c = *CARVEOUT.get_or_init(|| {
        let v = std::env::var("DSV4_SMEM_CARVEOUT").ok()?;
        let c = v.trim().parse::<i32>().ok().filter(|c| (0..=100).contains(c));
        if c.is_none() {
            tracing::warn!("DSV4_SMEM_CARVEOUT={v:?} is not 0 to 100; the driver's choice");
        }
        c
    });
    if let Some(c) = c {
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
            c,
        )?;
    }
    Ok(f)
}

impl Kernels {
    fn load(ctx: &Arc<CudaContext>) -> Result<Self, CudaInitError> {
        let d = compile(
            ctx,
            0,
            &[
                "gather_rows",
                "add",
                "copy_blocks",
                "gather_regions",
                "hc_expand",
                "stream_mean",
                "swiglu_act",
                "rms_norm",
                "rms_norm_warp",
                "rope",
                "rope_cast",
                "gemv_f32",
                "norm_many",
                "gemv_route",
                "side_delay",
                "chain_link",
                "chain_barrier",
            ],
        )?;
        let h = compile(
            ctx,
            1,
            &[
                "hc_pre_dot",
                "hc_pre_dot_rows",
                "hc_pre_dot_tc",
                "hc_pre_apply",
                "hc_pre_apply_norm",
                "hc_pre_sink_rows",
                "hc_post",
                "hc_post4",
                "hc_post_dot",
                "hc_head",
            ],
        )?;
        let a = compile(
            ctx,
            2,
            &[
                "comp_pool",
                "comp_store",
                "comp_pool_store",
                "index_score",
                "index_score_tc",
                "index_topk",
                "index_score_topk",
                "attention",
                "attention_tc",
                "attention_tcd",
                "attention_merge",
                "ring_write",
            ],
        )?;
        let m = compile(ctx, 3, &["route", "moe_up", "moe_down", "moe_combine"])?;
        let dr = compile(ctx, 5, &["draw_rows"])?;
        let mut bf = compile(
            ctx,
            4,
            &[
                "gemv_bf16",
                "cast_bf16",
                "moe_sort",
                "moe_gather_bf16",
                "swiglu_bf16",
                "moe_combine_sorted",
                "probe_finite",
                "rand_normal",
                "gemv1_bf16",
                "gemvt_bf16",
                "gemvt16_bf16",
                "gemvtp_bf16",
            ],
        )?
        .into_iter();
        let mut d = d.into_iter();
        let mut h = h.into_iter();
        let mut a = a.into_iter();
        let mut m = m.into_iter();
        let mut dr = dr.into_iter();
        let n = |it: &mut std::vec::IntoIter<CudaFunction>| it.next().unwrap();
        Ok(Kernels {
            gather_rows: n(&mut d),
            add: n(&mut d),
            copy_blocks: n(&mut d),
            gather_regions: n(&mut d),
            hc_expand: n(&mut d),
            stream_mean: n(&mut d),
            swiglu_act: n(&mut d),
            rms_norm: n(&mut d),
            rms_norm_warp: n(&mut d),
            rope: n(&mut d),
            rope_cast: n(&mut d),
            gemv_f32: n(&mut d),
            norm_many: n(&mut d),
            gemv_route: n(&mut d),
            side_delay: n(&mut d),
            chain_link: n(&mut d),
            chain_barrier: n(&mut d),
            hc_pre_dot: n(&mut h),
            hc_pre_dot_rows: n(&mut h),
            hc_pre_dot_tc: n(&mut h),
            hc_pre_apply: n(&mut h),
            hc_pre_apply_norm: n(&mut h),
            hc_pre_sink_rows: n(&mut h),
            hc_post: n(&mut h),
            hc_post4: n(&mut h),
            hc_post_dot: n(&mut h),
            hc_head: n(&mut h),
            comp_pool: n(&mut a),
            comp_store: n(&mut a),
            comp_pool_store: n(&mut a),
            index_score: n(&mut a),
            index_score_tc: n(&mut a),
            index_topk: n(&mut a),
            index_score_topk: n(&mut a),
            attention: n(&mut a),
            attention_tc: n(&mut a),
            attention_tcd: n(&mut a),
            attention_merge: n(&mut a),
            ring_write: n(&mut a),
            route: n(&mut m),
            moe_up: n(&mut m),
            moe_down: n(&mut m),
            moe_combine: n(&mut m),
            gemv_bf16: n(&mut bf),
            cast_bf16: n(&mut bf),
            moe_sort: n(&mut bf),
            moe_gather_bf16: n(&mut bf),
            swiglu_bf16: n(&mut bf),
            moe_combine_sorted: n(&mut bf),
            probe_finite: n(&mut bf),
            rand_normal: n(&mut bf),
            gemv1_bf16: n(&mut bf),
            gemvt_bf16: n(&mut bf),
            gemvt16_bf16: n(&mut bf),
            gemvtp_bf16: n(&mut bf),
            draw_rows: n(&mut dr),
        })
    }
}

/// Host vectors given back after use ([`Backend::recycle_host`]: the engine returns each step's
/// logits), so that the next large download lands in pages already mapped. A fresh `Vec` past
/// glibc's 32 MiB mmap threshold (its ceiling) is mapped and faulted in on every step: 80 rows
/// of V4's logits are 41 MB, and decode at 80 rows took 51.7 ms a step on logits against 22.5
/// with glibc's mmap off (4 q2 layers, H100, PERF.md v36).
#[derive(Default)]
pub(crate) struct HostVecs(Mutex<Vec<Vec<f32>>>);

/// How many given-back vectors [`HostVecs`] keeps (the largest), and the least capacity it
/// keeps (below it a fresh allocation comes from the heap, already mapped).
const HOST_VECS_KEEP: usize = 4;
const HOST_VECS_MIN: usize = (32 << 20) / std::mem::size_of::<f32>();

impl HostVecs {
    /// A vector of `n` values (contents unspecified: the caller overwrites them all), from the
    /// smallest kept one that holds `n`, else new.
    pub(crate) fn take(&self, n: usize) -> Vec<f32> {
        let mut kept = self.0.lock().unwrap();
        let best = kept.iter().enumerate().filter(|(_, v)| v.capacity() >= n).min_by_key(|(_, v)| v.capacity());
        let mut v = match best.map(|(i, _)| i) {
            Some(i) => kept.swap_remove(i),
            None => Vec::new(),
        };
        drop(kept);
        // Pages already written stay mapped: only a longer length writes (and faults in) more.
        v.truncate(n);
        v.resize(n, 0.0);
        v
    }

    /// Keeps `v` for a later [`HostVecs::take`] if it is large enough to be worth it, dropping
    /// the smallest kept one past [`HOST_VECS_KEEP`].
    pub(crate) fn give(&self, v: Vec<f32>) {
        if v.capacity() < HOST_VECS_MIN {
            return;
        }
        let mut kept = self.0.lock().unwrap();
        kept.push(v);
        if kept.len() > HOST_VECS_KEEP {
            let small = kept.iter().enumerate().min_by_key(|(_, v)| v.capacity()).map(|(i, _)| i).expect("non-empty");
            kept.swap_remove(small);
        }
    }
}

/// A side branch's stream and state ([`Backend::side_begin`]).
struct Side {
    stream: Arc<CudaStream>,
    /// Recorded on the main stream where a branch opens; the side stream waits for it.
    fork: CudaEvent,
    /// Recorded on the side stream where a branch ends; the main stream waits for it at the join.
    done: CudaEvent,
    /// The side branches that run on their stream, a mask of [`crate::backend::SideBranch`]
    /// bits ([`CudaBackend::set_side_mask`]).
    on: std::sync::atomic::AtomicU32,
    /// Most rows a step runs its side branches for (at most the recorded sizes,
    /// [`CudaBackend::set_side_rows`]).
    rows: std::sync::atomic::AtomicUsize,
    /// Ops are queued on the side stream (between `side_begin` and `side_end`).
    active: std::sync::atomic::AtomicBool,
    /// A branch has ended and its join is not queued yet.
    pending: std::sync::atomic::AtomicBool,
    /// Branches run on the side stream so far ([`CudaBackend::side_branches`]).
    count: std::sync::atomic::AtomicUsize,
    /// Nanoseconds the side stream waits at the start of each branch (`DSV4_SIDE_DELAY`, 0:
    /// none; [`CudaBackend::set_side_delay`]): a test's way to make a missing join show.
    delay: std::sync::atomic::AtomicI64,
}

/// Every side branch ([`crate::backend::SideBranch`]'s bits).
const SIDE_ALL: u32 = 3;

/// Start value of [`CudaBackend::set_side_mask`]: `DSV4_SIDE`, a mask of
/// [`crate::backend::SideBranch`] bits (1 the compressors, 2 the indexer's query product),
/// else 1. H100, 32 q2 layers, context 4096 (PERF.md v46): the compressors' branch takes a
/// one-row step 6.41–6.46 → 6.15–6.20 ms and a verify of 1 + 3 rows 10.27–10.42 → 9.81–9.93;
/// the indexer's query branch adds nothing to it (6.20 with both).
fn side_env() -> u32 {
    side_mask_in(std::env::var("DSV4_SIDE").ok().as_deref())
}

/// [`side_env`] of the variable's value, if set. Anything but a mask of 0 to [`SIDE_ALL`] turns
/// the branches off, with a warning. Bit 4 was the shared expert's gate/up beside the router: it
/// cost a one-row step 0.4 ms (PERF.md v46) and is gone, so a mask that still asks for it says so.
fn side_mask_in(v: Option<&str>) -> u32 {
    let Some(v) = v else { return 1 };
    match v.trim().parse::<u32>() {
        Ok(m) if m <= SIDE_ALL => m,
        Ok(m) if m <= 7 => {
            tracing::warn!(
                "DSV4_SIDE={v:?}: bit 4 (the shared expert beside the router) was removed (PERF.md v46); \
                 side branches off"
            );
            0
        }
        _ => {
            tracing::warn!("DSV4_SIDE={v:?} is not a mask of 0 to {SIDE_ALL}; side branches off");
            0
        }
    }
}

/// Start value of [`CudaBackend::set_side_rows`]: `DSV4_SIDE_ROWS`, else 16. Batches of 16 rows
/// tie with the branches on (22.03–22.10 ms against 22.09–22.19, H100, 32 layers) and batches of
/// 64 lose 0.1–0.3 ms (53.20–53.26 against 52.95–53.14).
fn side_rows_env() -> usize {
    std::env::var("DSV4_SIDE_ROWS").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(16)
}

/// The CUDA backend on one device.
pub struct CudaBackend {
    pub(crate) ctx: Arc<CudaContext>,
    /// The stream every op is queued on, but a side branch's ([`CudaBackend::stream`]).
    main: Arc<CudaStream>,
    /// A side branch's ops ([`Backend::side_begin`]): a second stream, forked from and joined
    /// to `main` by its two events.
    side: Side,
    blas: CudaBlas,
    pub(crate) k: Kernels,
    pub(crate) qk: quant::QuantKernels,
    staging: Mutex<Vec<Staging>>,
    freqs: Mutex<HashMap<Vec<u64>, Arc<CudaSlice<f64>>>>,
    pub(crate) expert_tables: Mutex<HashMap<Vec<u64>, Arc<CudaSlice<u64>>>>,
    /// A one-element buffer passed where a kernel's optional pointer is absent.
    pub(crate) dummy_f32: CudaSlice<f32>,
    pub(crate) dummy_u32: CudaSlice<u32>,
    pub(crate) dummy_f64: CudaSlice<f64>,
    pub(crate) dummy_i8: CudaSlice<i8>,
    /// Matrix weights in bf16 (see [`CudaWeight`]); f32 otherwise.
    pub bf16: bool,
    /// f32 activations in every bf16 product (the small-batch kernels at any batch size): the
    /// results then differ from a CPU run on bf16-rounded weights only by summation order.
    exact: std::sync::atomic::AtomicBool,
    /// Packed products on int8-quantised activations ([`crate::x8`]; on unless `DSV4_INT8=0`).
    int8: std::sync::atomic::AtomicBool,
    /// Most rows a packed product runs on int8 activations ([`Self::set_x8_rows`]).
    x8_rows: std::sync::atomic::AtomicUsize,
    /// Which int8 products take the tensor-core tiles ([`quant::X8Tiles`] as u8).
    x8_tiles: std::sync::atomic::AtomicU8,
    /// The dense Q8_0 tiles stage their chunks by cp.async ([`Self::set_tile_cp`]).
    tile_cp: std::sync::atomic::AtomicBool,
    /// Most rows a dense packed product runs on gemm.cu's tiles ([`Self::set_tiles_dense_rows`]).
    tiles_dense: std::sync::atomic::AtomicUsize,
    /// The routed experts' 128-row tiles on wgmma ([`Self::set_pgemm_wgmma`]).
    pgemm_wgmma: std::sync::atomic::AtomicBool,
    /// Prefill chunks' attention on tensor cores ([`Self::set_attention_tc`]).
    attention_tc: std::sync::atomic::AtomicBool,
    /// Multiprocessors of the device ([`Self::sm_count`]).
    sms: usize,
    /// Rows from which attention takes `attention_tc` ([`Self::set_attention_tc_rows`]).
    attention_tc_rows: std::sync::atomic::AtomicUsize,
    /// Prefill chunks' indexer scores on tensor cores ([`Self::set_index_tc`]).
    index_tc: std::sync::atomic::AtomicBool,
    /// Recorded steps' persistent inputs and outputs, and the step being recorded.
    pub(crate) steps: Mutex<graph::Steps>,
    /// Device copies of hash layers' `tid2eid` tables, by host address and length.
    hash_tables: Mutex<HashTables>,
    /// cuBLAS's workspace, set explicitly so that recorded products never allocate.
    _blas_workspace: CudaSlice<u8>,
    /// A packed weight the int8 products take was uploaded (the RMSNorms then write twins).
    pub(crate) x8_weights: std::sync::atomic::AtomicBool,
    /// The pair tables of 1 to [`bf16::SHARED_X8_ROWS`] rows through one expert
    /// ([`bf16::shared_pairs_words`]): the shared expert run by the routed-expert kernels.
    pub(crate) shared_pairs: CudaSlice<u32>,
    /// Zeroed counters of 32-value groups and tickets (`moe_up1s`, `gemv1xq`, `gemv_route`,
    /// the indexer: each launch leaves them zero, and launches on one stream never overlap):
    /// [`bf16::FFN1_COUNTERS`] of them, the main stream's ([`CudaBackend::counters`]).
    ffn1_cnt: CudaSlice<u32>,
    /// The same for the side stream's launches, which may overlap the main stream's.
    side_cnt: CudaSlice<u32>,
    /// Bumped by every setter that changes which kernels a step launches: part of the recorded
    /// steps' generation ([`CudaBackend::prepare_step`]), so a step recorded under other settings
    /// is recorded again rather than replayed.
    settings: std::sync::atomic::AtomicU64,
    /// Host vectors handed back after use ([`Backend::recycle_host`]), for the next download.
    host_vecs: HostVecs,
    /// One row's routed and shared experts in two launches (see [`CudaBackend::set_ffn1`]).
    ffn1: std::sync::atomic::AtomicBool,
    /// One row's int8 products of one input in one launch (see [`CudaBackend::set_x8_group`]).
    x8_group: std::sync::atomic::AtomicBool,
    /// A compressor's pooling and raw-ring store in one launch (see [`CudaBackend::set_comp_fused`]).
    comp_fused: std::sync::atomic::AtomicBool,
    /// HC_POST with the next HC_PRE's sums (see [`CudaBackend::set_hc_post_dot`]).
    hc_post_dot: std::sync::atomic::AtomicBool,
    /// wo_a's one-row product with its output's int8 codes (see [`CudaBackend::set_gemv_twin`]).
    gemv_twin: std::sync::atomic::AtomicBool,
    /// The decode attention kernel's epilogue (see [`CudaBackend::set_att_fused`]).
    att_fused: std::sync::atomic::AtomicBool,
    /// Decode-sized fast-mode attention on `attention_tc`'s key slices ([`CudaBackend::set_attention_tc_slices`]).
    attention_tc_slices: std::sync::atomic::AtomicBool,
    /// Heads a block of the decode slices (16, the default: `attention_tcd`; 64: `attention_tc`).
    attention_tc_heads: std::sync::atomic::AtomicUsize,
    /// One-row int8 products of k ≤ 1024 at 4 outputs a warp (see [`CudaBackend::set_gemv4`]).
    gemv4: std::sync::atomic::AtomicBool,
    /// Int8 calls of 2 to 4 rows on the kernels built for that many (see
    /// [`CudaBackend::set_row_caps`]).
    row_caps: std::sync::atomic::AtomicBool,
    /// Int8 products of 2 to 4 rows at two outputs a warp (see [`CudaBackend::set_row_pairs`]).
    row_pairs: std::sync::atomic::AtomicBool,
    /// Most rows whose experts take two launches (see [`CudaBackend::set_ffn1_rows`]).
    ffn1_rows: std::sync::atomic::AtomicUsize,
    /// The drafter's block attention on blocks of 4 heads (see [`CudaBackend::set_block_attention_heads`]).
    block_att_heads: std::sync::atomic::AtomicBool,
    /// The drafter's greedy Markov slot in one launch (see [`CudaBackend::set_markov_fused`]).
    markov_fused: std::sync::atomic::AtomicBool,
    /// f32-activation products of many rows on `gemvo` (see [`CudaBackend::set_gemvo`]).
    gemvo: std::sync::atomic::AtomicBool,
    /// A decode layer's attention norms and rotations two launches (see [`CudaBackend::set_norm_group`]).
    norm_group: std::sync::atomic::AtomicBool,
    /// The router's product with its choice in one launch (see [`CudaBackend::set_route_fused`]).
    route_fused: std::sync::atomic::AtomicBool,
    /// The indexer's scores and top-k in one launch (see [`CudaBackend::set_index_fused`]).
    index_fused: std::sync::atomic::AtomicBool,
    /// Prefetch blocks an HC_PRE or attention launch adds (see [`CudaBackend::set_l2_prefetch`]).
    l2_blocks: std::sync::atomic::AtomicU32,
    /// Weight planes ([`Backend::prefetch`]) the next launch that takes them prefetches:
    /// (address, bytes).
    l2_pending: std::sync::Mutex<Vec<(u64, u64)>>,
    /// Launches that carried prefetch blocks ([`CudaBackend::l2_prefetch_launches`]).
    l2_launches: std::sync::atomic::AtomicU64,
    /// `attention_tcd` launches queued ([`CudaBackend::attention_tcd_launches`]).
    pub(crate) tcd_launches: std::sync::atomic::AtomicU64,
    /// `gemv_route` launches queued ([`CudaBackend::gemv_route_launches`]).
    pub(crate) route_fused_launches: std::sync::atomic::AtomicU64,
    /// `markov_argmax` launches queued ([`CudaBackend::markov_fused_launches`]).
    pub(crate) markov_launches: std::sync::atomic::AtomicU64,
    pub(crate) fusion: Fusion,
}

/// common.cuh's `L2Ranges`: up to [`L2_RANGES`] weight ranges and the grid layers of blocks
/// that prefetch them, by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct L2Ranges {
    ptr: [u64; L2_RANGES],
    bytes: [u64; L2_RANGES],
    n: i32,
    /// Grid layers of prefetch blocks a launch adds past its own (0: none).
    pub(crate) layers: i32,
}

impl L2Ranges {
    pub(crate) const NONE: L2Ranges = L2Ranges { ptr: [0; L2_RANGES], bytes: [0; L2_RANGES], n: 0, layers: 0 };
}

/// `L2_RANGES` of common.cuh.
const L2_RANGES: usize = 8;
/// Rows up to which a launch takes prefetch blocks (decode and verify steps: their
/// products stream each weight once at a few rows; prefill's tiles are bound by arithmetic).
const L2_PREFETCH_ROWS: usize = 64;

// SAFETY: #[repr(C)] plain data, the field order and types of common.cuh's struct (two arrays
// of 8-byte words, two ints: no padding).
unsafe impl launch::KernelStruct for L2Ranges {}

/// Fusions that change launches but no value, each on by default and off with its variable set
/// to 0 (for A/B timing): `DSV4_X8_TWINS` (RMSNorms write int8 twins), `DSV4_SHARED_X8` (the
/// one-row shared expert on the routed-expert kernels), `DSV4_NORM_ROPE` (q/kv norm with RoPE),
/// `DSV4_HC_NORM` (HC_PRE's apply with the sub-block's norm).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Fusion {
    pub twins: bool,
    pub shared_x8: bool,
    /// `DSV4_NORM_ROPE`: q/kv RMSNorm and RoPE in one launch.
    pub norm_rope: bool,
    /// `DSV4_HC_NORM`: HC_PRE's apply and the sub-block's RMSNorm in one launch.
    pub hc_norm: bool,
    /// Values a thread in the RMSNorm (`DSV4_NORM_VALUES`, default 4; the block has at most
    /// 1024 threads).
    pub norm_values: usize,
    /// Most rows the shared expert takes on the routed-expert kernels (`DSV4_SHARED_X8_ROWS`,
    /// 1 to [`bf16::SHARED_X8_ROWS`], default the most; 1: one row only, the A/B).
    pub shared_rows: usize,
}

impl Fusion {
    fn from_env() -> Self {
        let on = |name: &str| std::env::var(name).map_or(true, |v| v.trim() != "0");
        let norm_values = std::env::var("DSV4_NORM_VALUES").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(4);
        Fusion {
            twins: on("DSV4_X8_TWINS"),
            shared_x8: on("DSV4_SHARED_X8"),
            norm_rope: on("DSV4_NORM_ROPE"),
            hc_norm: on("DSV4_HC_NORM"),
            norm_values: usize::max(norm_values, 1),
            shared_rows: std::env::var("DSV4_SHARED_X8_ROWS")
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(bf16::SHARED_X8_ROWS)
                .clamp(1, bf16::SHARED_X8_ROWS),
        }
    }
}

/// Device `tid2eid` tables by the host table's address and length, with the host contents
/// they were made from.
type HashTables = HashMap<(usize, usize), (Vec<u32>, Arc<CudaSlice<u32>>)>;

/// Rows from which an inverse RoPE also writes the tensor's bf16 copy (`rope_cast`): prefill
/// chunks, where the attention output (n × 64 heads × 512) is read once for both instead of
/// once by `rope` (1.0 TB/s on its strided pairs) and again by `cast_bf16`.
const ROPE_CAST_ROWS: usize = 256;

/// Bytes of cuBLAS workspace (what cuBLAS takes by default on Hopper).
const BLAS_WORKSPACE: usize = 32 << 20;

/// `⌈total / block⌉` blocks of `block` threads (at least one block).
pub(crate) fn cfg1d(total: usize, block: u32) -> LaunchConfig {
    let grid = total.div_ceil(block as usize).clamp(1, 1 << 20) as u32;
    LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 }
}

/// A block size for reducing over `width` elements: a multiple of 32, at most 256.
pub(crate) fn block_for(width: usize) -> u32 {
    (width.div_ceil(32) * 32).clamp(32, 256) as u32
}

pub(crate) fn ck<T, E: std::fmt::Debug>(r: Result<T, E>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("CUDA {what}: {e:?}"))
}

impl CudaBackend {
    /// Opens device `ordinal` with bf16 matrix weights (see [`CudaWeight`]).
    pub fn new(ordinal: usize) -> Result<Self, CudaInitError> {
        Self::with_weights(ordinal, true)
    }

    /// Opens device `ordinal` with f32 weights throughout (the first backend's numerics).
    pub fn new_f32(ordinal: usize) -> Result<Self, CudaInitError> {
        Self::with_weights(ordinal, false)
    }

    /// Called by each setter after it stores its value (so a step that reads the new epoch
    /// also reads the new value).
    pub(crate) fn bump_settings(&self) {
        self.settings.fetch_add(1, std::sync::atomic::Ordering::Release);
    }

    /// How many times the settings that pick kernels have changed ([`CudaBackend::bump_settings`]).
    pub(crate) fn settings_epoch(&self) -> u64 {
        self.settings.load(std::sync::atomic::Ordering::Acquire)
    }

    /// f32 activations in every bf16 product, whatever the batch (tests; slower prefill).
    pub fn set_exact(&self, on: bool) {
        self.exact.store(on, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    /// Whether exact mode is on (see [`CudaBackend::set_exact`]).
    pub fn exact(&self) -> bool {
        self.exact.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The MoE experts of one token row, or of up to [`Self::ffn1_rows`] rows, in two launches
    /// (`moe_up1s`: every row's routed slots' and shared expert's gate/up with the SwiGLU, h's
    /// int8 codes by the last block of each 32-value group; `moe_down1s`: every pair's down
    /// rows, the routing-weighted sum and the add of the shared expert), instead of moe_sort, up,
    /// quant_x8, down, moe_combine and the shared expert's up, quant_x8, down, then add: 9
    /// launches. The same values bit for bit. Start value `DSV4_FFN1` (`0`/`1`), else
    /// `DSV4_DECODE_FUSIONS`; on by default.
    pub fn set_ffn1(&self, on: bool) {
        self.ffn1.store(on, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn ffn1(&self) -> bool {
        self.ffn1.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The products of packed int8-format weights of one input ([`crate::Backend::matmul_many`]:
    /// the attention input's wq_a and wkv, qr's wq_b and the indexer's wq_b) in one launch a
    /// format, bitwise the launches one by one: of one row (`gemv1xg`), and of 2 to 4 rows where
    /// those take two outputs a warp (`gemvxg4p`, [`Self::set_row_pairs`]). Start value `DSV4_X8_GROUP` (`0`/`1`),
    /// else `DSV4_DECODE_FUSIONS`; on by default.
    pub fn set_x8_group(&self, on: bool) {
        self.x8_group.store(on, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn x8_group(&self) -> bool {
        self.x8_group.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A compressor's pooling (`comp_pool`) and raw-ring store (`comp_store`) in one launch
    /// (`comp_pool_store`) where every segment of the batch is short
    /// ([`crate::batch::SHORT_SEGMENT`] rows: decode and verify), so the two touch distinct ring
    /// slots; the same values. Start value `DSV4_COMP_FUSED` (`0`/`1`), else `DSV4_DECODE_FUSIONS`;
    /// on by default.
    pub fn set_comp_fused(&self, on: bool) {
        self.comp_fused.store(on, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn comp_fused(&self) -> bool {
        self.comp_fused.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// HC_POST forms the next HC_PRE's partial sums over the streams it writes (`hc_post_dot`,
    /// kept on the result) where that HC_PRE takes `hc_pre_dot` (decode batches; every call in
    /// exact mode): one launch fewer an HC_PRE, the same values. Start value `DSV4_HC_POST_DOT`
    /// (`0`/`1`), else `DSV4_DECODE_FUSIONS`; off by default (slower at 16 rows, v24).
    pub fn set_hc_post_dot(&self, on: bool) {
        self.hc_post_dot.store(on, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn hc_post_dot(&self) -> bool {
        self.hc_post_dot.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The one-row wo_a product also writes its output's int8 codes (`gemv1xq`: the last of the
    /// blocks of each 32-value group quantises it), so wo_b skips its `quant_x8` launch; the
    /// same values. Start value `DSV4_GEMV_TWIN` (`0`/`1`), else `DSV4_DECODE_FUSIONS`; on by
    /// default.
    pub fn set_gemv_twin(&self, on: bool) {
        self.gemv_twin.store(on, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn gemv_twin(&self) -> bool {
        self.gemv_twin.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The decode attention kernel (not `attention_tc`) forms the inverse RoPE of its output
    /// and, on the int8 path, the output's int8 codes where it merges the slices, writes the
    /// window ring's rows itself where segments are short (decode, verify), and keeps its slice
    /// counters in a buffer each launch leaves zero: no `rope`, `quant_x8`, `ring_write` or
    /// counter memset beside it. The same values. Start value `DSV4_ATT_FUSED` (`0`/`1`), else
    /// `DSV4_DECODE_FUSIONS`; on by default.
    pub fn set_att_fused(&self, on: bool) {
        self.att_fused.store(on, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn att_fused(&self) -> bool {
        self.att_fused.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// One-row int8 products of at most 1,024 inputs (wq_b, the indexer's wq_b) with 4 outputs a
    /// warp (`gemv1x4`, `gemv1xg4`; see `gemv4_fits`): the same sums. Start value `DSV4_GEMV4`
    /// (`0`/`1`), else `DSV4_DECODE_FUSIONS`; on by default.
    pub fn set_gemv4(&self, on: bool) {
        self.gemv4.store(on, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn gemv4(&self) -> bool {
        self.gemv4.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Int8 products of 2 and 3–4 rows, and the routed experts' down products of calls of that
    /// many token rows, on the several-row kernels built for at most that many rows (`gemvx2`,
    /// `gemvx4`, `moe_downx2`, `moe_downx4`: 61–80 registers where the general ones hold
    /// 102–128, offline sm_90a), the same values. On unless `DSV4_ROW_CAPS=0` (PERF.md v25:
    /// 43 q2 layers, batch 2 12.24 → 11.42 ms a step, verify 1 + 1 12.62 → 11.79 ms).
    pub fn set_row_caps(&self, on: bool) {
        self.row_caps.store(on, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn row_caps(&self) -> bool {
        self.row_caps.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Int8 products of 2 and 3–4 rows (with [`CudaBackend::set_row_caps`]) at two outputs a
    /// warp (`gemvx2p`, `gemvx4p`) where a group's outputs are even: the warp's two weight rows
    /// share each activation load and have twice the bytes in flight, the same sums an output.
    /// The one-output kernels' warps live one DRAM trip each (k ≤ 4,096: one pass of the loop),
    /// so these products ran at 1.3–2.2 TB/s where one row reads 3.3 (H200 kernel table), and a
    /// DSpark verify of 3 rows pays that on every dense projection. On unless
    /// `DSV4_ROW_PAIRS=0`.
    pub fn set_row_pairs(&self, on: bool) {
        self.row_pairs.store(on, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn row_pairs(&self) -> bool {
        self.row_pairs.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Most token rows whose MoE experts take the two launches of one row (`moe_up1s`,
    /// `moe_down1s`; their n-row forms past 1): a verify of 1 + 1..3 drafts would launch 2
    /// kernels for its experts where the several-row path launches 9. Each pair is its own
    /// one-row product there, so an expert two rows chose, and the shared expert, are read
    /// once a row. With the rows in registers (quant.cu `X8_STAGE 0`: 234 and 128 registers,
    /// 1 and 2 blocks an SM) that lost (H100, 32 q2 layers, PERF.md v43: verify 1+2 9.73 ms
    /// and 1+3 11.33 against 9.27 and 10.53 with 1). Staged through shared memory (80 and 64
    /// registers, 3 and 4 blocks, the built-in since v52) it wins: verify 1+1 / 1+2 / 1+3
    /// 6.26 / 7.38 / 8.32 ms against 6.84 / 8.27 / 9.45 with 1 (PERF.md v52). So the start
    /// value is 4 with the staged kernels and 1 without (`DSV4_FFN1_ROWS`, 1 to 8).
    pub fn set_ffn1_rows(&self, rows: usize) {
        assert!((1..=bf16::FFN1_MAX_ROWS).contains(&rows), "ffn1 rows {rows}: 1 to {}", bf16::FFN1_MAX_ROWS);
        self.ffn1_rows.store(rows, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn ffn1_rows(&self) -> usize {
        self.ffn1_rows.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The DSpark block attention at V4's head width on `block_attention_h`, each key read once
    /// for 4 heads, or a block a (row, head): the same bits. Start value `DSV4_BLOCK_ATT_HEADS=1`
    /// (off until it has run on a GPU: PERF.md v53).
    pub fn set_block_attention_heads(&self, on: bool) {
        self.block_att_heads.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn block_attention_heads(&self) -> bool {
        self.block_att_heads.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The drafter's greedy Markov slot ([`Backend::markov_argmax`]) in one launch where it gives
    /// the separate ops' ids (`markov_argmax` of dspark.cu), or as those ops. Start value
    /// `DSV4_MARKOV_FUSED=1` (off until it has run on a GPU: PERF.md v53).
    pub fn set_markov_fused(&self, on: bool) {
        self.markov_fused.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn markov_fused(&self) -> bool {
        self.markov_fused.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether routed experts of `pairs` (row, slot) pairs over `experts` experts take the int8
    /// tiles under [`quant::X8Tiles::Dense`] (the default, which keeps them off at decode
    /// sizes: one or two pairs an expert, PERF.md v14): from `DSV4_EXPERT_TILE_PAIRS` (4) pairs an
    /// expert on average, e.g. a served step carrying prompts in exact mode. The tiles give the
    /// dp4a row groups' sums, so the choice is one of speed only; 0 turns it off.
    pub fn expert_tiles(&self, pairs: usize, experts: usize) -> bool {
        static PER: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        let per = *PER.get_or_init(|| {
            std::env::var("DSV4_EXPERT_TILE_PAIRS").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(4)
        });
        per > 0 && pairs >= per * experts
    }

    /// Packed products on f32 activations (exact mode) of 17 rows or more on `gemvo`, a warp
    /// taking 4 outputs so that each activation load serves 4, where `gemv` loads it for each
    /// output: the same values (exact mode's prefill and served mixed steps ran on the L1's
    /// load rate). On unless `DSV4_GEMVO=0`.
    pub fn set_gemvo(&self, on: bool) {
        self.gemvo.store(on, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn gemvo(&self) -> bool {
        self.gemvo.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A decode layer's attention norms and rotations ([`crate::Backend::norms`]) in two
    /// launches (`norm_many`): q_a's norm with kv's norm + RoPE, then the heads' norm + RoPE
    /// with the indexer query's RoPE, where each ran its own (−2 launches a CSA layer, −1 on
    /// the others). Each job's values are those of its own launch bit for bit. Start value
    /// `DSV4_NORM_GROUP` (`0`/`1`), else `DSV4_DECODE_FUSIONS`; on by default.
    pub fn set_norm_group(&self, on: bool) {
        self.norm_group.store(on, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn norm_group(&self) -> bool {
        self.norm_group.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The router's product with f32 weights (`gemv_f32`, one block an expert) and its choice
    /// of experts (`route`) in one launch ([`crate::Backend::router`]: `gemv_route`, whose last
    /// block routes every row): one launch fewer a layer, the same values (the two kernels'
    /// files are both compiled without contraction). Start value `DSV4_ROUTE_FUSED` (`0`/`1`), else
    /// `DSV4_DECODE_FUSIONS`; on by default.
    pub fn set_route_fused(&self, on: bool) {
        self.route_fused.store(on, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn route_fused(&self) -> bool {
        self.route_fused.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The lightning indexer's scores (`index_score`) and top-k (`index_topk`) in one launch
    /// (`index_score_topk`: each row's last block to finish its scores selects the row's
    /// entries) where every segment is short (decode and verify): one launch fewer a CSA
    /// layer, the same values. Start value `DSV4_INDEX_FUSED` (`0`/`1`), else
    /// `DSV4_DECODE_FUSIONS`; on by default.
    pub fn set_index_fused(&self, on: bool) {
        self.index_fused.store(on, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn index_fused(&self) -> bool {
        self.index_fused.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The decode fusions at their defaults (`on`: nine on, HC_POST_DOT at
    /// [`HC_POST_DOT_DEFAULT`]) or all ten off, so one process can time a step both ways (`dsv4
    /// bench --decode-fusions 0,1`). (Before 1d81188 `on` turned all ten on, as
    /// `DSV4_DECODE_FUSIONS=1` still does at start.)
    pub fn set_decode_fusions(&self, on: bool) {
        self.set_ffn1(on);
        self.set_x8_group(on);
        self.set_comp_fused(on);
        self.set_hc_post_dot(on && HC_POST_DOT_DEFAULT);
        self.set_gemv_twin(on);
        self.set_att_fused(on);
        self.set_gemv4(on);
        self.set_norm_group(on);
        self.set_route_fused(on);
        self.set_index_fused(on);
    }

    /// Whether `t` carries int8 codes (an RMSNorm or a product wrote them beside it).
    pub fn has_x8_twin(&self, t: &CudaTensor) -> bool {
        t.x8.get().is_some()
    }

    /// The two-launch path of [`CudaBackend::set_ffn1`] alone, whatever the setting: `(routed,
    /// shared, routed + shared)` of x's rows, `None` where it does not apply (tests compare it
    /// with the separate launches).
    pub fn moe_shared_two_launches(
        &self,
        x: &CudaTensor,
        route: &CudaRoute,
        experts: &[Expert<CudaWeight>],
        shared: &Expert<CudaWeight>,
        limit: f32,
    ) -> Option<(CudaTensor, CudaTensor, CudaTensor)> {
        bf16::ffn_few_rows(self, x, route, experts, 0, shared, limit)
    }

    /// A route of the given expert ids and weights (`k` slots a row, row-major), as the router
    /// would leave it: the expert kernels' benchmark picks its experts itself (`dsv4 bench
    /// --synthetic kernels`, the experts table), e.g. one expert in every slot so that a call's
    /// weights stay in L2.
    pub fn route_from_host(&self, k: usize, experts: usize, ids: &[u32], weights: &[f32]) -> CudaRoute {
        assert!(
            k > 0 && ids.len() == weights.len() && ids.len().is_multiple_of(k),
            "route: {} ids, {} weights, k {k}",
            ids.len(),
            weights.len()
        );
        assert!(ids.iter().all(|&e| (e as usize) < experts), "route: an expert id past {experts}");
        CudaRoute {
            k,
            experts,
            ids: ck(self.stream().clone_htod(ids), "route ids"),
            weights: ck(self.stream().clone_htod(weights), "route weights"),
        }
    }

    /// Products of Q8_0, Q2_K and IQ2_XXS weights on int8-quantised activations up to 16 rows,
    /// and the routed experts of those formats at any batch the grouped kernels take (dp4a;
    /// [`crate::x8`] is their CPU twin, and says what the rounding costs). On by default (dp4a
    /// over 1-byte activations: 1.3 instructions a weight where the f32 path spends ~8, PERF.md
    /// v8); `DSV4_INT8=0` turns it off at start, and [`Self::exact_or_skip`] (tests) too. Each
    /// row is quantised on its own, so a row's result still does not depend on its batch.
    pub fn set_int8(&self, on: bool) {
        self.int8.store(on, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn int8(&self) -> bool {
        self.int8.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Packed products of more rows than this take the bf16 path (dequantised weights, cuBLAS),
    /// whose results depend on the row count; up to it a row's result does not. Starts at
    /// `DSV4_X8_MAX_ROWS` or [`quant::QGEMV_ROWS`].
    pub fn set_x8_rows(&self, rows: usize) {
        self.x8_rows.store(rows, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn x8_rows(&self) -> usize {
        self.x8_rows.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Which int8 products run on the tensor-core tiles (the same results either way; timing
    /// and tests). Starts at `DSV4_X8_TILES`.
    pub fn set_x8_tiles(&self, t: quant::X8Tiles) {
        self.x8_tiles.store(t as u8, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn x8_tiles(&self) -> quant::X8Tiles {
        quant::X8Tiles::from_u8(self.x8_tiles.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Whether the dense Q8_0 tiles copy their chunks into shared memory by cp.async
    /// (`gemvtc`, PERF.md v29) or load them into registers (`gemvt`): the same sums either way.
    /// Starts at `DSV4_TILE_CP` (off unless 1: measured 6 % slower on the H100, PERF.md v29).
    pub fn set_tile_cp(&self, on: bool) {
        self.tile_cp.store(on, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn tile_cp(&self) -> bool {
        self.tile_cp.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Most rows a dense packed product above the int8 path's rows runs on gemm.cu's
    /// tensor-core tiles (the weight decoded in the tile load); more rows take the bf16 scratch
    /// and cuBLAS. Starts at [`gemm::TILES_DENSE_ROWS`] (`DSV4_PGEMM_DENSE_ROWS`): the tiles
    /// save the scratch at decode batches (batch 64, 4 q2 layers: 15.2 against 20.2 ms a step),
    /// cuBLAS is faster from 256 rows (PERF.md v18). Routed experts take the tiles either way.
    pub fn set_tiles_dense_rows(&self, rows: usize) {
        self.tiles_dense.store(rows, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn tiles_dense_rows(&self) -> usize {
        self.tiles_dense.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether the routed experts' 128-row tiles run on wgmma (gemm.cu's `pgemm_{up,down}128w`:
    /// operands read from swizzled shared memory, no ldmatrix) instead of mma.sync. Starts on
    /// unless `DSV4_PGEMM_WGMMA=0`: an 8K chunk's routed experts on 4 q2 layers took 44.9 ms
    /// against 64.5 on mma.sync (H200, PERF.md v19).
    pub fn set_pgemm_wgmma(&self, on: bool) {
        self.pgemm_wgmma.store(on, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn pgemm_wgmma(&self) -> bool {
        self.pgemm_wgmma.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether fast-mode attention of calls of [`Self::attention_tc_rows`] rows and more takes
    /// `attention_tc` (bf16 queries, keys and weights on tensor cores, f32 sums) or the f32
    /// kernel. Starts on unless `DSV4_ATT_TC=0`.
    pub fn set_attention_tc(&self, on: bool) {
        self.attention_tc.store(on, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    /// The device's multiprocessors (the dense tiles' split of k: [`gemm::dense_splits`]).
    pub fn sm_count(&self) -> usize {
        self.sms
    }

    pub fn attention_tc(&self) -> bool {
        self.attention_tc.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Rows from which a fast-mode attention call takes `attention_tc` (one block a row, its 64
    /// heads sharing every key) rather than the f32 kernel (key slices that spread a few rows
    /// over the GPU). Start value `DSV4_ATT_TC_ROWS`, else [`attention::ATC_MIN_ROWS`].
    pub fn set_attention_tc_rows(&self, rows: usize) {
        self.attention_tc_rows.store(rows.max(1), std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn attention_tc_rows(&self) -> usize {
        self.attention_tc_rows.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether fast-mode attention of calls below [`Self::attention_tc_rows`] rows (decode and
    /// verify) takes `attention_tc` cut into key slices (a row's tiles over up to 16 blocks, then
    /// `attention_merge` with the f32 kernel's merge and epilogue) rather than the f32 kernel
    /// (one warp a head, ~120 instructions a key and head: 25–35 µs a layer at batch 1 and
    /// context 4096, PERF.md v25). bf16 queries, keys and weights with f32 sums, as prefill's
    /// attention_tc; the slices are a function of the row alone, so a row's result never
    /// depends on its batch. On by default since the merge runs on (row, head) blocks
    /// (`DSV4_ATT_TC_SLICES=0` turns it off): 4 q2 layers on an H200, batch 1 −4.5 %, batch 16
    /// −2.6 % (PERF.md v27); with [`Self::set_attention_tc`].
    pub fn set_attention_tc_slices(&self, on: bool) {
        self.attention_tc_slices.store(on, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn attention_tc_slices(&self) -> bool {
        self.attention_tc_slices.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Heads a block of the decode slices: 16 (`attention_tcd`, the default: a quarter of the
    /// queries to load, of the partials to write and of a warp's QK / PV work, on 4× the blocks;
    /// PERF.md v50: attention_tc 16–19 → 8–10 µs a layer, −0.23 ms a 32-layer H100 step) or 64
    /// (`attention_tc`, the form before). The slices and every row's result stay functions of the
    /// row alone; the sums' order over d differs (8 spans of 64 channels, not 2 of 256), so the
    /// two forms' values differ in the last bits. Start value: `DSV4_ATT_TC_HEADS` (16 or 64);
    /// any other value gives 16.
    pub fn set_attention_tc_heads(&self, heads: usize) {
        let h = if heads == attention::ATC_HEADS { heads } else { attention::ATCD_HEADS };
        self.attention_tc_heads.store(h, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn attention_tc_heads(&self) -> usize {
        self.attention_tc_heads.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Blocks an HC_PRE or attention launch of at most 64 rows adds to prefetch the weights the
    /// forward names next ([`Backend::prefetch`]: the attention's wq_a, wkv and wq_b, its wo_a;
    /// the router and the shared expert) into L2 with `cp.async.bulk.prefetch` while the
    /// launch's own blocks run: those products then read L2 rather than HBM (PERF.md v25:
    /// HC_PRE and the attention leave ~100 µs of a 216 µs layer to latency-bound kernels at a
    /// few % of DRAM bandwidth). 0 (the default, `DSV4_L2_PREFETCH` sets it) adds none; no value
    /// ever changes.
    pub fn set_l2_prefetch(&self, blocks: u32) {
        self.l2_pending.lock().unwrap().clear();
        self.l2_blocks.store(blocks, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn l2_prefetch(&self) -> u32 {
        self.l2_blocks.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The ranges [`Backend::prefetch`] named since the last launch that took them (taken:
    /// each is prefetched once), for a launch of `rows` rows whose extra grid layers hold
    /// `per_layer` blocks each: as many layers as [`Self::l2_prefetch`]'s blocks fill (at most
    /// two blocks an SM in all).
    pub(crate) fn take_l2_ranges(&self, rows: usize, per_layer: usize) -> L2Ranges {
        let pending = std::mem::take(&mut *self.l2_pending.lock().unwrap());
        let mut r = L2Ranges::NONE;
        let blocks = (self.l2_prefetch() as usize).min(2 * self.sms);
        if blocks == 0 || rows > L2_PREFETCH_ROWS || pending.is_empty() {
            return r;
        }
        for (i, &(p, b)) in pending.iter().take(L2_RANGES).enumerate() {
            r.ptr[i] = p;
            r.bytes[i] = b;
        }
        r.n = pending.len().min(L2_RANGES) as i32;
        r.layers = blocks.div_ceil(per_layer.max(1)) as i32;
        self.l2_launches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        r
    }

    /// Launches that have carried L2 prefetch blocks (a test's evidence that they ran).
    pub fn l2_prefetch_launches(&self) -> u64 {
        self.l2_launches.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// `markov_argmax` launches queued (a test's evidence that a Markov slot ran fused).
    pub fn markov_fused_launches(&self) -> u64 {
        self.markov_launches.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// `attention_tcd` launches queued, eager or recorded (a test's evidence that the 16-head
    /// slices ran).
    pub fn attention_tcd_launches(&self) -> u64 {
        self.tcd_launches.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// `gemv_route` launches (the router's product and choice in one launch) queued since the
    /// backend started: tests check that the fused path ran.
    pub fn gemv_route_launches(&self) -> u64 {
        self.route_fused_launches.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether fast-mode indexer scores of prefill-sized calls (256 rows and more, V4-Flash's
    /// 64 heads of 128) take `index_score_tc` (bf16 queries and entries on tensor cores, f32
    /// sums) or the f32 kernel. Starts on unless `DSV4_INDEX_TC=0`.
    pub fn set_index_tc(&self, on: bool) {
        self.index_tc.store(on, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn index_tc(&self) -> bool {
        self.index_tc.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Opens device `ordinal`, compiles the kernels and creates the stream and cuBLAS handle.
    pub fn with_weights(ordinal: usize, bf16: bool) -> Result<Self, CudaInitError> {
        // SAFETY: these only try to dlopen the libraries.
        unsafe {
            if !cudarc::driver::sys::is_culib_present() {
                return Err(CudaInitError::NoDriver);
            }
            if !cudarc::nvrtc::sys::is_culib_present() {
                return Err(CudaInitError::NoLibrary("NVRTC"));
            }
            if !cudarc::cublas::sys::is_culib_present() {
                return Err(CudaInitError::NoLibrary("cuBLAS"));
            }
        }
        if CudaContext::device_count().map_err(|_| CudaInitError::NoDevice)? <= ordinal as i32 {
            return Err(CudaInitError::NoDevice);
        }
        let ctx = CudaContext::new(ordinal)?;
        keep_pool_memory(ordinal);
        let sms = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_or(132, |v| v.max(1) as usize);
        // One stream: ordering is the stream's, so cudarc's per-buffer event tracking is not needed.
        // SAFETY: every buffer of this backend is used on `stream` only.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let blas = CudaBlas::new(stream.clone())?;
        let ws = stream.alloc_zeros::<u8>(BLAS_WORKSPACE)?;
        // SAFETY: the workspace outlives the handle (both are fields of the backend, the
        // workspace dropped after the handle) and is used on the handle's stream only.
        unsafe {
            let (p, _g) = ws.device_ptr(&stream);
            let r =
                cudarc::cublas::sys::cublasSetWorkspace_v2(*blas.handle(), p as *mut std::ffi::c_void, BLAS_WORKSPACE);
            r.result()?;
        }
        let k = Kernels::load(&ctx)?;
        // index_score stages a row's queries and its warps' keys: over the default 48 KB of
        // dynamic shared memory at Flash's indexer shape (the launcher checks the bound).
        for f in [&k.index_score, &k.index_score_topk] {
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                attention::INDEX_SCORE_SMEM as i32,
            )?;
        }
        k.attention_tc.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            attention::ATC_SMEM as i32,
        )?;
        k.attention_tcd.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            attention::atc_smem(attention::ATCD_HEADS) as i32,
        )?;
        k.index_score_tc.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            attention::ITC_SMEM as i32,
        )?;
        let qk = quant::QuantKernels::load(&ctx)?;
        let dummy_f32 = stream.alloc_zeros::<f32>(1)?;
        let dummy_u32 = stream.alloc_zeros::<u32>(1)?;
        let dummy_f64 = stream.alloc_zeros::<f64>(1)?;
        let dummy_i8 = stream.alloc_zeros::<i8>(1)?;
        let shared_pairs = stream.clone_htod(&bf16::shared_pairs_words())?;
        let ffn1_cnt = stream.alloc_zeros::<u32>(bf16::FFN1_COUNTERS)?;
        let side_cnt = stream.alloc_zeros::<u32>(bf16::FFN1_COUNTERS)?;
        let side = Side {
            stream: ctx.new_stream()?,
            fork: ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))?,
            done: ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))?,
            on: std::sync::atomic::AtomicU32::new(side_env()),
            rows: std::sync::atomic::AtomicUsize::new(side_rows_env()),
            active: std::sync::atomic::AtomicBool::new(false),
            pending: std::sync::atomic::AtomicBool::new(false),
            count: std::sync::atomic::AtomicUsize::new(0),
            delay: std::sync::atomic::AtomicI64::new(
                std::env::var("DSV4_SIDE_DELAY").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(0),
            ),
        };
        Ok(CudaBackend {
            ctx,
            main: stream,
            side,
            blas,
            k,
            qk,
            staging: Mutex::new(Vec::new()),
            freqs: Mutex::new(HashMap::new()),
            expert_tables: Mutex::new(HashMap::new()),
            dummy_f32,
            dummy_u32,
            dummy_f64,
            dummy_i8,
            bf16,
            exact: std::sync::atomic::AtomicBool::new(false),
            int8: std::sync::atomic::AtomicBool::new(std::env::var("DSV4_INT8").map_or(true, |v| v.trim() != "0")),
            x8_rows: std::sync::atomic::AtomicUsize::new(quant::qgemv_rows_env()),
            x8_tiles: std::sync::atomic::AtomicU8::new(quant::X8Tiles::from_env() as u8),
            tile_cp: std::sync::atomic::AtomicBool::new(std::env::var("DSV4_TILE_CP").is_ok_and(|v| v.trim() == "1")),
            attention_tc: std::sync::atomic::AtomicBool::new(
                std::env::var("DSV4_ATT_TC").map_or(true, |v| v.trim() != "0"),
            ),
            sms,
            attention_tc_rows: std::sync::atomic::AtomicUsize::new(
                std::env::var("DSV4_ATT_TC_ROWS")
                    .ok()
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(attention::ATC_MIN_ROWS)
                    .max(1),
            ),
            index_tc: std::sync::atomic::AtomicBool::new(
                std::env::var("DSV4_INDEX_TC").map_or(true, |v| v.trim() != "0"),
            ),
            tiles_dense: std::sync::atomic::AtomicUsize::new(
                std::env::var("DSV4_PGEMM_DENSE_ROWS")
                    .ok()
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(gemm::TILES_DENSE_ROWS),
            ),
            pgemm_wgmma: std::sync::atomic::AtomicBool::new(
                std::env::var("DSV4_PGEMM_WGMMA").map_or(true, |v| v.trim() != "0"),
            ),
            steps: Mutex::new(graph::Steps::default()),
            hash_tables: Mutex::new(HashMap::new()),
            _blas_workspace: ws,
            x8_weights: std::sync::atomic::AtomicBool::new(false),
            shared_pairs,
            ffn1_cnt,
            side_cnt,
            settings: std::sync::atomic::AtomicU64::new(0),
            host_vecs: HostVecs::default(),
            ffn1: std::sync::atomic::AtomicBool::new(decode_fusion("DSV4_FFN1")),
            x8_group: std::sync::atomic::AtomicBool::new(decode_fusion("DSV4_X8_GROUP")),
            comp_fused: std::sync::atomic::AtomicBool::new(decode_fusion("DSV4_COMP_FUSED")),
            hc_post_dot: std::sync::atomic::AtomicBool::new(decode_fusion("DSV4_HC_POST_DOT")),
            gemv_twin: std::sync::atomic::AtomicBool::new(decode_fusion("DSV4_GEMV_TWIN")),
            att_fused: std::sync::atomic::AtomicBool::new(decode_fusion("DSV4_ATT_FUSED")),
            gemv4: std::sync::atomic::AtomicBool::new(decode_fusion("DSV4_GEMV4")),
            l2_blocks: std::sync::atomic::AtomicU32::new(
                std::env::var("DSV4_L2_PREFETCH").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(0),
            ),
            l2_pending: std::sync::Mutex::new(Vec::new()),
            l2_launches: std::sync::atomic::AtomicU64::new(0),
            tcd_launches: std::sync::atomic::AtomicU64::new(0),
            route_fused_launches: std::sync::atomic::AtomicU64::new(0),
            markov_launches: std::sync::atomic::AtomicU64::new(0),
            row_caps: std::sync::atomic::AtomicBool::new(
                std::env::var("DSV4_ROW_CAPS").map_or(true, |v| v.trim() != "0"),
            ),
            row_pairs: std::sync::atomic::AtomicBool::new(
                std::env::var("DSV4_ROW_PAIRS").map_or(true, |v| v.trim() != "0"),
            ),
            ffn1_rows: std::sync::atomic::AtomicUsize::new(bf16::ffn1_rows_env()),
            block_att_heads: std::sync::atomic::AtomicBool::new(
                std::env::var("DSV4_BLOCK_ATT_HEADS").is_ok_and(|v| v.trim() == "1"),
            ),
            markov_fused: std::sync::atomic::AtomicBool::new(
                std::env::var("DSV4_MARKOV_FUSED").is_ok_and(|v| v.trim() == "1"),
            ),
            gemvo: std::sync::atomic::AtomicBool::new(std::env::var("DSV4_GEMVO").map_or(true, |v| v.trim() != "0")),
            attention_tc_heads: std::sync::atomic::AtomicUsize::new(
                match std::env::var("DSV4_ATT_TC_HEADS").ok().and_then(|v| v.trim().parse().ok()) {
                    Some(attention::ATC_HEADS) => attention::ATC_HEADS,
                    _ => attention::ATCD_HEADS,
                },
            ),
            attention_tc_slices: std::sync::atomic::AtomicBool::new(
                std::env::var("DSV4_ATT_TC_SLICES").map_or(true, |v| v.trim() != "0"),
            ),
            norm_group: std::sync::atomic::AtomicBool::new(decode_fusion("DSV4_NORM_GROUP")),
            route_fused: std::sync::atomic::AtomicBool::new(decode_fusion("DSV4_ROUTE_FUSED")),
            index_fused: std::sync::atomic::AtomicBool::new(decode_fusion("DSV4_INDEX_FUSED")),
            fusion: Fusion::from_env(),
        })
    }

    /// For tests: the backend (bf16 weights, or f32 with `f32_weights`) in exact mode, or `None`
    /// after printing `skipping: no CUDA device (…)` where no driver, library or device is
    /// present (CI). Any other failure to start panics: that is a bug, not a missing GPU.
    pub fn exact_or_skip(f32_weights: bool) -> Option<Self> {
        match Self::with_weights(0, !f32_weights) {
            Ok(b) => {
                b.set_exact(true);
                b.set_int8(false);
                Some(b)
            }
            Err(e @ (CudaInitError::NoDriver | CudaInitError::NoDevice | CudaInitError::NoLibrary(_))) => {
                println!("skipping: no CUDA device ({e})");
                None
            }
            Err(e) => panic!("CUDA backend failed to start: {e}"),
        }
    }

    /// The device's name.
    /// A device buffer's values on the host (tests, benchmarks' CPU twins; synchronises the
    /// stream).
    pub fn download<T: cudarc::driver::DeviceRepr>(&self, s: &CudaSlice<T>) -> Vec<T> {
        let v = ck(self.main_stream().clone_dtoh(s), "download");
        self.synchronize();
        v
    }

    pub fn device_name(&self) -> String {
        self.ctx.name().unwrap_or_default()
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) {
        ck(self.main.synchronize(), "synchronize");
        ck(self.side.stream.synchronize(), "synchronize the side stream");
    }

    /// The main stream: where steps are recorded and where host reads, snapshots and
    /// collectives are ordered (never inside a side branch, so the same as [`Self::stream`]
    /// wherever the forward calls them; named so that no branch can ever take them).
    pub(crate) fn main_stream(&self) -> &Arc<CudaStream> {
        debug_assert!(!self.in_branch(), "a host read inside a side branch");
        &self.main
    }

    /// The zeroed counters of the stream ops are queued on (see `ffn1_cnt`): a side branch's
    /// launches may run beside the main stream's, so each stream has its own.
    pub(crate) fn counters(&self) -> &CudaSlice<u32> {
        if self.in_branch() {
            &self.side_cnt
        } else {
            &self.ffn1_cnt
        }
    }

    /// Whether ops are being queued on the side stream (between `side_begin` and `side_end`).
    fn in_branch(&self) -> bool {
        self.side.active.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The stream ops are queued on: the side stream inside a side branch, else the main one.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        if self.in_branch() {
            &self.side.stream
        } else {
            &self.main
        }
    }

    /// All side branches or none ([`Backend::side_begin`]: a layer's compressors beside its
    /// query path, the indexer's query product beside the heads') on a second stream, forked
    /// from the main one and joined to it (a fork and a join in a recorded step); off, every op
    /// runs on the main stream in order. The same kernels on the same inputs, so the same
    /// values. Start value `DSV4_SIDE` (a mask, [`CudaBackend::set_side_mask`]; 1, the
    /// compressors' branch, by default). Like every setter, called between steps, from the
    /// thread that runs them.
    pub fn set_side(&self, on: bool) {
        self.set_side_mask(if on { SIDE_ALL } else { 0 });
    }

    /// The side branches that run ([`crate::backend::SideBranch`]'s bits; [`CudaBackend::set_side`]
    /// sets all or none).
    pub fn set_side_mask(&self, mask: u32) {
        self.side_join();
        self.side.on.store(mask & SIDE_ALL, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn side(&self) -> bool {
        self.side_mask() != 0
    }

    /// Most rows of a step whose side branches run (past them, and past the recorded sizes, the
    /// branches run in order). Start value `DSV4_SIDE_ROWS`, else 16.
    pub fn set_side_rows(&self, rows: usize) {
        self.side_join();
        self.side.rows.store(rows, std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    pub fn side_rows(&self) -> usize {
        self.side.rows.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn side_mask(&self) -> u32 {
        self.side.on.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Makes each side branch start `ns` nanoseconds late (one thread waits on the side stream
    /// first; 0: not at all), so that an op reading a branch's output before its join, or a
    /// buffer freed before the branch is done with it, meets values not yet written. A test
    /// setting: it changes no value of a correct step.
    pub fn set_side_delay(&self, ns: i64) {
        self.side.delay.store(ns.max(0), std::sync::atomic::Ordering::Relaxed);
        self.bump_settings();
    }

    /// Side branches run on the side stream so far (eager and recorded forwards): a test's
    /// evidence that the branch it compares ran.
    pub fn side_branches(&self) -> usize {
        self.side.count.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Runs `f` (a cuBLAS call: its handle is bound to the main stream and its workspace is
    /// one) on the main stream, in the side branch's order where one is open: the main stream
    /// waits for the side's work so far, and the side for `f`'s.
    pub(crate) fn on_main<R>(&self, f: impl FnOnce() -> R) -> R {
        if !self.in_branch() {
            return f();
        }
        self.side_fence();
        let r = f();
        ck(self.side.fork.record(&self.main), "main record");
        ck(self.side.stream.wait(&self.side.fork), "side waits for the main stream");
        r
    }

    /// Makes the main stream wait for the side branch's work so far (before a buffer it reads
    /// is freed on the main stream); nothing outside a branch.
    pub(crate) fn side_fence(&self) {
        if self.in_branch() {
            ck(self.side.done.record(&self.side.stream), "side record");
            ck(self.main.wait(&self.side.done), "main waits for the side");
        }
    }

    /// A buffer an op uses and drops before it returns (a split-k partial sum): inside a side
    /// branch it is owned by the side stream, so its free is queued there after the branch's
    /// kernels that use it (a buffer `alloc` hands out there is freed on the main stream, which
    /// is right only for one that outlives the branch); elsewhere as `alloc`.
    pub(crate) fn scratch<T: cudarc::driver::DeviceRepr>(&self, n: usize) -> CudaSlice<T> {
        if self.in_branch() {
            // SAFETY: as `alloc`; every caller writes the elements it later reads.
            return ck(unsafe { self.side.stream.alloc::<T>(n.max(1)) }, "alloc");
        }
        self.alloc(n)
    }

    /// An uninitialised device buffer of `n` elements (at least one), in the order of the stream
    /// ops are queued on. It is freed on the main stream: inside a side branch it is taken on
    /// the side stream and handed to the main one, whose ops read it after the join, so its
    /// free is queued after them (and a recorded step's side branch holds no free to join).
    /// A buffer dropped inside the branch must come from [`CudaBackend::scratch`] instead.
    pub(crate) fn alloc<T: cudarc::driver::DeviceRepr>(&self, n: usize) -> CudaSlice<T> {
        if !self.in_branch() {
            // SAFETY: every caller writes the elements it later reads.
            return ck(unsafe { self.main.alloc::<T>(n.max(1)) }, "alloc");
        }
        let bytes = n.max(1) * std::mem::size_of::<T>();
        // SAFETY: a stream-ordered allocation on the side stream (the context has async
        // allocation, as `CudaStream::alloc` on the device requires); the slice owns it and
        // frees it on the main stream, after every op that reads it (the main stream's own, and
        // the side's, joined before anything reads a side output). Callers write before reading.
        unsafe {
            let p = ck(cudarc::driver::result::malloc_async(self.side.stream.cu_stream(), bytes), "alloc");
            self.main.upgrade_device_ptr::<T>(p, n.max(1))
        }
    }

    /// RMSNorm of every `group`-wide slice, with RoPE on each (`rope`: the row table and the
    /// frequencies; group a multiple of 32) and the int8 twin where it serves a product.
    fn norm(
        &self,
        x: &CudaTensor,
        w: Option<&CudaWeight>,
        group: usize,
        eps: f32,
        rope: Option<(&CudaRows, &[f64])>,
    ) -> CudaTensor {
        let mut out = self.tensor(x.rows, x.cols);
        let groups = x.rows * x.cols / group;
        if groups == 0 {
            return out;
        }
        let (wd, has_w) = match w {
            Some(w) => (&w.data, 1i32),
            None => (&self.dummy_f32, 0),
        };
        let twin = self.twin_for(group, x.cols);
        let tw = self.twin_buffers(twin, x.rows * x.cols);
        let (xq, xd) = tw.as_ref().map_or((&self.dummy_i8, &self.dummy_f32), |t| (&t.q, &t.d));
        let threads = self.norm_threads(group);
        let cfg = LaunchConfig { grid_dim: (groups as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        let rope = rope.filter(|(_, f)| !f.is_empty());
        let table = rope.map_or(&self.dummy_u32, |(rows, _)| rows.dev.as_ref());
        let freqs = rope.map(|(_, f)| self.freqs(f));
        let npairs = rope.map_or(0, |(_, f)| f.len()) as i32;
        let fd = freqs.as_deref().unwrap_or(&self.dummy_f64);
        if group == 512 && threads == 128 && !twin && groups >= NORM_WARP_GROUPS {
            // Many groups of 512 (a prefill chunk's q heads): a warp a group, bitwise rms_norm's
            // values (dense.cu's rms_norm_warp).
            let lc = LaunchConfig {
                grid_dim: (groups.div_ceil(8) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument types and sizes match the kernel's signature (out and x hold
            // groups · 512 floats; the row table and freqs as for rms_norm).
            ck(
                unsafe {
                    self.stream()
                        .kernel(&self.k.rms_norm_warp)
                        .arg(&mut out.data)
                        .arg(&x.data)
                        .arg(wd)
                        .arg(&has_w)
                        .arg(&eps)
                        .arg(table)
                        .arg(&(x.rows as i32))
                        .arg(&((x.cols / group) as i32))
                        .arg(&(groups as i64))
                        .arg(fd)
                        .arg(&npairs)
                        .launch(lc)
                },
                "rms_norm_warp",
            );
            return out;
        }
        // SAFETY: argument types and sizes match the kernel's signature (xq/xd hold the whole
        // output's codes and scales when `twin`).
        ck(
            unsafe {
                self.stream()
                    .kernel(&self.k.rms_norm)
                    .arg(&mut out.data)
                    .arg(xq)
                    .arg(xd)
                    .arg(&x.data)
                    .arg(wd)
                    .arg(&has_w)
                    .arg(&(group as i32))
                    .arg(&eps)
                    .arg(&(twin as i32))
                    .arg(table)
                    .arg(&(x.rows as i32))
                    .arg(&((x.cols / group) as i32))
                    .arg(fd)
                    .arg(&npairs)
                    .launch(cfg)
            },
            "rms_norm",
        );
        if let Some(t) = tw {
            let _ = out.x8.set(t);
        }
        out
    }

    /// Threads of an RMSNorm block over `group` values: about `norm_values` each (a decode row
    /// is one block, whose latency is the per-thread work), a multiple of 32, at most 1024.
    fn norm_threads(&self, group: usize) -> u32 {
        (group.div_ceil(self.fusion.norm_values).div_ceil(32) * 32).clamp(32, 1024) as u32
    }

    /// Whether `norm_many` forms `job` as its own launch would (see [`CudaBackend::norm`] and
    /// [`crate::Backend::rms_norm_rope`]: the plain `rms_norm` kernel, RoPE inside the norm).
    fn norm_job_fits(&self, job: &NormJob<'_, CudaTensor, CudaWeight>, freqs: &[f64]) -> bool {
        let (x, ok) = match job {
            NormJob::Norm { x, group, rope, .. } => {
                let g = *group;
                let groups = (x.rows * x.cols).checked_div(g).unwrap_or(0);
                let warp = g == 512 && self.norm_threads(g) == 128 && !self.twin_for(g, x.cols);
                let rope_ok = !*rope
                    || freqs.is_empty()
                    || (g.is_multiple_of(32) && 2 * freqs.len() <= g && self.fusion.norm_rope);
                (
                    *x,
                    g > 0 && x.cols.is_multiple_of(g) && groups > 0 && !(warp && groups >= NORM_WARP_GROUPS) && rope_ok,
                )
            }
            NormJob::Rope { x, head } => {
                let h = *head;
                (x, h > 0 && x.cols.is_multiple_of(h) && !freqs.is_empty() && 2 * freqs.len() <= h)
            }
        };
        ok && (1..=NORM_GROUP_ROWS).contains(&x.rows)
    }

    /// [`crate::Backend::norms`] of two jobs in one launch (`norm_many`; see
    /// [`CudaBackend::set_norm_group`]): each RMSNorm on a block of its own launch's threads
    /// (the others of the launch's block idle), each RoPE in place.
    fn norm_many(
        &self,
        jobs: Vec<NormJob<'_, CudaTensor, CudaWeight>>,
        rows: &CudaRows,
        freqs: &[f64],
    ) -> Vec<CudaTensor> {
        assert_eq!(jobs.len(), 2, "norm_many takes two jobs");
        let threads = jobs
            .iter()
            .map(|j| match j {
                NormJob::Norm { group, .. } => self.norm_threads(*group),
                NormJob::Rope { .. } => 32,
            })
            .max()
            .unwrap_or(32);
        let f = self.freqs(freqs);
        let np = freqs.len() as i32;
        let mut g = NormJobsDev::default();
        let mut outs = Vec::with_capacity(2);
        let mut twins = Vec::with_capacity(2);
        let mut blocks = 0usize;
        let mut n = 0usize;
        for (i, job) in jobs.into_iter().enumerate() {
            let d = &mut g.j[i];
            d.b0 = blocks as i32;
            match job {
                NormJob::Norm { x, w, group, eps, rope } => {
                    let out = self.tensor(x.rows, x.cols);
                    let twin = self.twin_for(group, x.cols);
                    let tw = self.twin_buffers(twin, x.rows * x.cols);
                    d.out = self.dev_ptr(&out.data);
                    d.x = self.dev_ptr(&x.data);
                    (d.xq, d.xd) = match &tw {
                        Some(t) => (self.dev_ptr(&t.q), self.dev_ptr(&t.d)),
                        None => (self.dev_ptr(&self.dummy_i8), self.dev_ptr(&self.dummy_f32)),
                    };
                    d.w = w.map_or_else(|| self.dev_ptr(&self.dummy_f32), |w| self.dev_ptr(&w.data));
                    d.has_w = w.is_some() as i32;
                    d.eps = eps;
                    d.group = group as i32;
                    d.twin = twin as i32;
                    d.heads = (x.cols / group) as i32;
                    d.npairs = if rope { np } else { 0 };
                    d.nt = self.norm_threads(group) as i32;
                    blocks += x.rows * x.cols / group;
                    n = x.rows;
                    outs.push(out);
                    twins.push(tw);
                }
                NormJob::Rope { mut x, head } => {
                    d.out = self.dev_ptr(x.data_mut());
                    d.cols = x.cols as i32;
                    d.head = head as i32;
                    d.npairs = np;
                    blocks += (x.rows * (x.cols / head) * freqs.len()).div_ceil(threads as usize);
                    n = x.rows;
                    outs.push(x);
                    twins.push(None);
                }
            }
        }
        assert!(outs.iter().all(|o| o.rows == n), "norm_many: every job holds the batch's rows");
        g.count = 2;
        g.blocks = blocks as i32;
        let lc = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument types match the kernel (NormJobsDev is dense.cu's struct). Each norm
        // job reads x and w (group wide) and writes a fresh output of x's shape and its twin
        // buffers (when twin); each RoPE job rotates its tensor's rows (cols a multiple of
        // head) in place; the row table holds n rows' positions.
        ck(
            unsafe {
                self.stream()
                    .kernel(&self.k.norm_many)
                    .arg_struct(&g)
                    .arg(rows.dev.as_ref())
                    .arg(&(n as i32))
                    .arg(f.as_ref())
                    .launch(lc)
            },
            "norm_many",
        );
        for (o, t) in outs.iter().zip(twins) {
            if let Some(t) = t {
                let _ = o.x8.set(t);
            }
        }
        outs
    }

    /// Whether a norm of `group`-wide slices of `cols`-wide rows writes the int8 twin: a
    /// whole-row norm feeds products, where int8 products are in use (see CudaTensor::x8).
    fn twin_for(&self, group: usize, cols: usize) -> bool {
        group == cols
            && group.is_multiple_of(crate::x8::BLOCK)
            && self.int8()
            && self.fusion.twins
            && self.x8_weights.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Buffers for the int8 twin of `len` values (the kernels write them), where `twin`; the
    /// launch passes the one-element dummies otherwise (no allocation).
    fn twin_buffers(&self, twin: bool, len: usize) -> Option<X8Twin> {
        twin.then(|| X8Twin { q: self.alloc::<i8>(len), d: self.alloc::<f32>(len / crate::x8::BLOCK) })
    }

    /// HC_PRE's partial sums (hc_pre_dot, or hc_pre_dot_rows for prefill-sized calls in fast
    /// mode): `[rows, HC_SPLIT, mix + 1]`.
    /// Whether HC_PRE's sums over `rows` rows take `hc_pre_dot` (decode batches, and every call
    /// in exact mode) rather than the prefill kernels.
    fn hc_dot_plain(&self, rows: usize, n: usize, width: usize) -> bool {
        !(rows >= HC_DOT_ROWS_MIN && n == 4 && width.is_multiple_of(128 * HC_SPLIT) && !self.exact())
    }

    fn hc_pre_dot<'a>(&self, x: &'a CudaTensor, hc: &Hc<CudaWeight>, cfg: &Config) -> HcPart<'a> {
        let n = cfg.hc_mult;
        assert!(n <= 8, "hc_mult {n} > 8");
        let (mix, width, rows) = ((2 + n) * n, n * cfg.hidden, x.rows);
        assert!(
            hc.fn_.bf.is_none() && hc.fn_.q.is_none() && (hc.fn_.rows, hc.fn_.cols) == (mix, width),
            "hc fn: an f32 [{mix}, {width}] weight (the loader keeps hc_* tensors in f32)"
        );
        // Formed beside the streams by the HC_POST that wrote them (hc_post_dot).
        if let Some((_, part)) = x.hc_part.get().filter(|(f, _)| *f == self.dev_ptr(&hc.fn_.data)) {
            if self.hc_dot_plain(rows, n, width) {
                return HcPart::Kept(part);
            }
        }
        let mut part = self.alloc::<f32>(rows * HC_SPLIT * (mix + 1));
        if !self.hc_dot_plain(rows, n, width) {
            // Prefill-sized calls: 16 rows a warp on tensor cores in 3xTF32, 8 slices a block
            // (hc.cu's hc_pre_dot_tc); with DSV4_HC_DOT_TC=0 16 rows and every output a block in
            // f32 FMAs (hc_pre_dot_rows, HC_DOT_R = 2 rows a warp).
            let tc = hc_dot_tc();
            let lc = LaunchConfig {
                grid_dim: if tc {
                    ((HC_SPLIT / 8) as u32, rows.div_ceil(16) as u32, 1)
                } else {
                    (HC_SPLIT as u32, rows.div_ceil(16) as u32, 1)
                },
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let kernel = if tc { &self.k.hc_pre_dot_tc } else { &self.k.hc_pre_dot_rows };
            // SAFETY: argument types and buffer sizes match the kernel's signature (part holds
            // rows · HC_SPLIT · (mix + 1) floats).
            ck(
                unsafe {
                    self.stream()
                        .kernel(kernel)
                        .arg(&mut part)
                        .arg(&x.data)
                        .arg(&hc.fn_.data)
                        .arg(&(rows as i32))
                        .arg(&(width as i32))
                        .launch(lc)
                },
                if tc { "hc_pre_dot_tc" } else { "hc_pre_dot_rows" },
            );
            return HcPart::Formed(part);
        }
        let dot = hc_dot_grid(rows, mix);
        // SAFETY: argument types and buffer sizes match the kernel's signature (part holds
        // rows · HC_SPLIT · (mix + 1) floats).
        ck(
            unsafe {
                self.stream()
                    .kernel(&self.k.hc_pre_dot)
                    .arg(&mut part)
                    .arg(&x.data)
                    .arg(&hc.fn_.data)
                    .arg(&(rows as i32))
                    .arg(&(mix as i32))
                    .arg(&(width as i32))
                    .launch(dot)
            },
            "hc_pre_dot",
        );
        HcPart::Formed(part)
    }

    pub(crate) fn tensor(&self, rows: usize, cols: usize) -> CudaTensor {
        CudaTensor::new(rows, cols, self.alloc(rows * cols))
    }

    /// The first `n` values of `src` in a host vector from [`HostVecs`] (ordered on the stream;
    /// the caller synchronises before reading it).
    pub(crate) fn download_reusing(&self, src: &CudaSlice<f32>, n: usize) -> Vec<f32> {
        let mut v = self.host_vecs.take(n);
        if n > 0 {
            ck(self.main_stream().memcpy_dtoh(&src.slice(..n), &mut v[..]), "download");
        }
        v
    }

    /// Rows `tokens[..n]` of `table` ([`Backend::embed`], [`Backend::embed_ids`]).
    fn embed_view(&self, table: &CudaWeight, tokens: &cudarc::driver::CudaView<'_, u32>, n: usize) -> CudaTensor {
        let mut out = self.tensor(n, table.cols);
        match &table.bf {
            Some(bf) => self.gather_bf16(&mut out, bf, tokens, n, table.cols),
            None => self.gather(&out, &table.data, tokens, n, table.cols),
        }
        out
    }

    /// Copies `data` to a new device buffer through a pinned staging buffer, ordered on the
    /// stream; the staging buffer is not written again until the stream has passed the copy.
    pub(crate) fn upload_u32(&self, data: &[u32]) -> CudaSlice<u32> {
        let mut pool = self.staging.lock().unwrap();
        let ready = pool.iter().position(|s| s.buf.len() >= data.len() && s.done.is_complete());
        let mut st = match ready {
            Some(i) => pool.swap_remove(i),
            None => Staging {
                // SAFETY: the buffer is written below before it is read.
                buf: ck(unsafe { self.ctx.alloc_pinned::<u32>(data.len().max(256).next_power_of_two()) }, "pin"),
                done: ck(self.ctx.new_event(None), "event"),
            },
        };
        // `as_mut_slice` also waits for the buffer's last copy (already complete here).
        ck(st.buf.as_mut_slice(), "staging")[..data.len()].copy_from_slice(data);
        let mut dst = self.alloc::<u32>(st.buf.len());
        ck(self.stream().memcpy_htod(&st.buf, &mut dst), "upload");
        ck(st.done.record(self.stream()), "record");
        pool.push(st);
        dst
    }

    /// The device copy of a hash layer's `tid2eid` table, uploaded once per table. Found by the
    /// host table's address and length, then checked against the copy kept beside it: a backend
    /// can outlive a model (a server reloading, tests), and the next model's table may land at
    /// the same address with other contents (a memcmp of a few MB, on eager forwards only: a
    /// replayed step does not call it).
    pub(crate) fn hash_table(&self, t: &[u32]) -> Arc<CudaSlice<u32>> {
        let key = (t.as_ptr() as usize, t.len());
        let mut m = self.hash_tables.lock().unwrap();
        if let Some((host, dev)) = m.get(&key) {
            if host.as_slice() == t {
                return dev.clone();
            }
        }
        let dev = Arc::new(ck(self.stream().clone_htod(t), "upload tid2eid"));
        m.insert(key, (t.to_vec(), dev.clone()));
        dev
    }

    /// The RoPE frequency table on the device (uploaded once per distinct table).
    /// Whether an inverse RoPE takes `rope_cast` (the rotation and the bf16 copy of the whole
    /// tensor in one pass): fast-mode calls of [`ROPE_CAST_ROWS`] rows and more (prefill chunks,
    /// whose wo_a product reads that copy), with the bf16 copies kept (`DSV4_BF16_CACHE`) and
    /// `DSV4_ROPE_CAST` not 0.
    fn rope_cast_fits(&self, x: &CudaTensor, head: usize, np: usize) -> bool {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let on = *ON.get_or_init(|| std::env::var("DSV4_ROPE_CAST").map_or(true, |v| v.trim() != "0"));
        on && x.rows >= ROPE_CAST_ROWS
            && !self.exact()
            && bf16::keep_bf16()
            && head.is_multiple_of(8)
            && (2 * np).is_multiple_of(8)
            && 2 * np <= head
            && np <= 256
            && x.cols.is_multiple_of(head)
    }

    pub(crate) fn freqs(&self, freqs: &[f64]) -> Arc<CudaSlice<f64>> {
        let key: Vec<u64> = freqs.iter().map(|f| f.to_bits()).collect();
        let mut m = self.freqs.lock().unwrap();
        if let Some(f) = m.get(&key) {
            return f.clone();
        }
        let mut v = freqs.to_vec();
        v.push(0.0); // never empty
                     // On the main stream, in a side branch's order (both chains read the table).
        let f = Arc::new(self.on_main(|| ck(self.main.clone_htod(&v), "upload freqs")));
        m.insert(key, f.clone());
        f
    }

    /// A device array of addresses (expert weight tables), uploaded once per distinct content.
    pub(crate) fn address_table(&self, ptrs: Vec<u64>) -> Arc<CudaSlice<u64>> {
        let mut m = self.expert_tables.lock().unwrap();
        if let Some(t) = m.get(&ptrs) {
            return t.clone();
        }
        let t = Arc::new(self.on_main(|| ck(self.main.clone_htod(&ptrs), "upload address table")));
        m.insert(ptrs, t.clone());
        t
    }

    pub(crate) fn dev_ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (p, _sync) = s.device_ptr(self.stream());
        p
    }

    /// `out[n, m] = x[n, k] · w[m, k]ᵀ`: up to [`bf16::gemv_rows`] rows, and at any row count in
    /// exact mode, `gemv_f32` (batch invariant), else cuBLAS (column-major: `outᵀ = w · xᵀ`).
    /// Exact mode (`dsv4 serve`'s default) promises one kernel path for any batch, so a prompt's
    /// prefill chunks of more than 16 rows (the router gate, the mHC mixes) must not take cuBLAS,
    /// whose kernel depends on the shape.
    pub(crate) fn gemm_xwt(
        &self,
        x: &CudaSlice<f32>,
        n: usize,
        k: usize,
        w: &CudaSlice<f32>,
        m: usize,
    ) -> CudaSlice<f32> {
        let mut out = self.alloc::<f32>(n * m);
        if n == 0 || m == 0 {
            return out;
        }
        if n <= bf16::gemv_rows() || self.exact() {
            // Wide rows (mHC: 16384) get 1024 threads: more loads in flight per output.
            let threads = if k >= 8192 { 1024 } else { 256 };
            // A block per output and group of 8 rows (one row: the single-accumulator path).
            let ys = if n == 1 { 1 } else { n.div_ceil(8).min(bf16::GRID_Y_MAX) };
            let lc =
                LaunchConfig { grid_dim: (m as u32, ys as u32, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: argument types and buffer sizes match the kernel.
            ck(
                unsafe {
                    self.stream()
                        .kernel(&self.k.gemv_f32)
                        .arg(&mut out)
                        .arg(x)
                        .arg(w)
                        .arg(&(n as i32))
                        .arg(&(k as i32))
                        .arg(&(m as i32))
                        .launch(lc)
                },
                "gemv_f32",
            );
            return out;
        }
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: m as i32,
            n: n as i32,
            k: k as i32,
            alpha: 1.0f32,
            lda: k as i32,
            ldb: k as i32,
            beta: 0.0f32,
            ldc: m as i32,
        };
        // SAFETY: the shapes above match the buffers' lengths.
        self.on_main(|| ck(unsafe { self.blas.gemm(cfg, w, x, &mut out) }, "sgemm"));
        out
    }
}

impl Backend for CudaBackend {
    type W = CudaWeight;
    type T = CudaTensor;
    type Cache = CudaCache;
    type Rows = CudaRows;
    type Ids = CudaIds;
    type Sel = CudaSel;
    type Route = CudaRoute;
    type Graph = graph::StepGraph;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn side_runs(&self, rows: usize, branch: crate::backend::SideBranch) -> bool {
        // Decode and verify steps (the recorded sizes); a prefill chunk's products fill the
        // device alone.
        self.side_mask() & branch as u32 != 0
            && rows <= self.side.rows.load(std::sync::atomic::Ordering::Relaxed).min(graph::GRAPH_MAX_ROWS)
    }

    fn side_begin(&self, rows: usize, branch: crate::backend::SideBranch) {
        debug_assert!(!self.in_branch(), "a side branch opened inside another");
        if !self.side_runs(rows, branch) || self.in_branch() {
            return;
        }
        // A branch ended but not joined stays pending: this one follows it on the side stream,
        // and the join waits for both (`done` is recorded again at this one's end).
        ck(self.side.fork.record(&self.main), "side fork");
        ck(self.side.stream.wait(&self.side.fork), "side fork wait");
        self.side.active.store(true, std::sync::atomic::Ordering::Relaxed);
        self.side.count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let ns = self.side.delay.load(std::sync::atomic::Ordering::Relaxed);
        if ns > 0 {
            // SAFETY: the kernel takes one i64 and touches no memory.
            ck(unsafe { self.stream().kernel(&self.k.side_delay).arg(&ns).launch(cfg1d(1, 32)) }, "side_delay");
        }
    }

    fn side_end(&self) {
        if self.side.active.swap(false, std::sync::atomic::Ordering::Relaxed) {
            ck(self.side.done.record(&self.side.stream), "side end");
            self.side.pending.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn side_join(&self) {
        if self.side.pending.swap(false, std::sync::atomic::Ordering::Relaxed) {
            ck(self.main.wait(&self.side.done), "side join");
        }
    }

    fn prefetch(&self, ws: &[&CudaWeight]) {
        if self.l2_prefetch() == 0 {
            return;
        }
        fn range<T>(s: &CudaSlice<T>, stream: &CudaStream) -> (u64, u64) {
            (launch::KernelArg::word(s, stream), (s.len() * std::mem::size_of::<T>()) as u64)
        }
        let mut p = self.l2_pending.lock().unwrap();
        p.clear();
        for w in ws {
            match (&w.q, &w.bf) {
                (Some(q), _) => p.extend([range(&q.blocks, self.stream()), range(&q.scales, self.stream())]),
                (None, Some(bf)) => p.push(range(bf, self.stream())),
                (None, None) => p.push(range(&w.data, self.stream())),
            }
        }
    }

    fn upload(&self, t: HostTensor) -> Result<CudaWeight, LoadError> {
        let (rows, cols) = match t.shape.as_slice() {
            [c] => (1, *c),
            [r, c] => (*r, *c),
            other => return Err(LoadError::Value { name: t.name, msg: format!("unexpected rank {}", other.len()) }),
        };
        let mut t = t;
        if let Some(p) = &t.packed {
            if self.bf16 && crate::bf16::keeps_packed(&t.name, &t.shape, p.format) {
                if let Some(w) = self.upload_packed(&t.name, rows, cols, p)? {
                    return Ok(w);
                }
            }
            t.dequantize();
        }
        let name = t.name.clone();
        let err = |e: cudarc::driver::DriverError| LoadError::Value {
            name: name.clone(),
            msg: format!("CUDA upload: {e:?}"),
        };
        if self.bf16 && crate::bf16::is_bf16_weight(&t.name, &t.shape) {
            let h: Vec<u16> = t.data.iter().map(|&v| crate::bf16::to_bf16_bits(v)).collect();
            let bf = self.stream().clone_htod(&h).map_err(err)?;
            return Ok(CudaWeight { rows, cols, data: self.alloc(1), bf: Some(bf), q: None });
        }
        let data = self.stream().clone_htod(&t.data).map_err(err)?;
        Ok(CudaWeight { rows, cols, data, bf: None, q: None })
    }

    fn keeps_packed(&self) -> bool {
        true
    }

    /// The bf16 and packed expert paths take a share of the experts; the f32 one does not.
    fn expert_parallel(&self) -> bool {
        self.bf16
    }

    fn resident_bytes(&self, t: &HostTensor) -> u64 {
        let (r, c) = t.rows_cols();
        match &t.packed {
            Some(p) if self.bf16 && crate::bf16::keeps_packed(&t.name, &t.shape, p.format) => {
                dsv4_model::Packed::device_bytes_of(p.format, r, c)
            }
            _ if self.bf16 && crate::bf16::is_bf16_weight(&t.name, &t.shape) => (r * c * 2) as u64,
            _ => (r * c * 4) as u64,
        }
    }

    fn memory_free(&self) -> Option<u64> {
        Some(self.mem_free() as u64)
    }

    fn new_cache(&self, cfg: &Config, max_seqs: usize) -> CudaCache {
        CudaCache::new(self, cfg, max_seqs)
    }

    fn reserve_state(&self, cache: &mut CudaCache, tokens: usize) {
        cache.reserve_tokens(self, tokens);
    }

    fn reset_seq(&self, cache: &mut CudaCache, seq: usize) {
        cache.reset(self, seq);
    }

    fn save_seq(&self, cache: &CudaCache, cfg: &Config, seq: usize, len: usize) -> Option<crate::SeqState> {
        Some(cache.save(self, cfg, seq, len))
    }

    fn save_seq_deferred(&self, cache: &CudaCache, cfg: &Config, seq: usize, len: usize) -> Option<crate::SavedState> {
        Some(crate::SavedState::Pending(cache.save_begin(self, cfg, seq, len)))
    }

    fn truncate_seq(&self, cache: &mut CudaCache, seq: usize, have: usize, len: usize) -> Result<(), String> {
        cache.truncate(seq, have, len)
    }

    fn load_seq(&self, cache: &mut CudaCache, cfg: &Config, seq: usize, st: &crate::SeqState, len: usize) -> bool {
        cache.load(self, cfg, seq, st, len)
    }

    fn rows(&self, batch: &Batch) -> CudaRows {
        if let Some(dev) = self.recorded_rows(batch.len()) {
            return CudaRows { batch: batch.clone(), dev };
        }
        let mut v = vec![0u32; 6 * batch.len()];
        graph::row_table(batch, &mut v);
        CudaRows { batch: batch.clone(), dev: Arc::new(self.upload_u32(&v)) }
    }

    fn shape(&self, t: &CudaTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn to_host(&self, t: &CudaTensor) -> Vec<f32> {
        self.to_host_rows(t, t.rows)
    }

    fn to_host_rows(&self, t: &CudaTensor, rows: usize) -> Vec<f32> {
        let v = self.download_reusing(&t.data, rows.min(t.rows) * t.cols);
        ck(self.stream().synchronize(), "synchronize");
        v
    }

    fn recycle_host(&self, v: Vec<f32>) {
        self.host_vecs.give(v);
    }

    fn embed(&self, table: &CudaWeight, rows: &CudaRows) -> CudaTensor {
        let n = rows.len();
        self.embed_view(table, &rows.dev.as_ref().slice(2 * n..3 * n), n)
    }

    fn matmul(&self, x: &CudaTensor, w: &CudaWeight) -> CudaTensor {
        assert_eq!(x.cols, w.cols, "matmul: input width {} vs weight [{}, {}]", x.cols, w.rows, w.cols);
        if let Some(q) = &w.q {
            return self.matmul_packed(x, q, w.rows, w.cols, 1);
        }
        if let Some(bf) = &w.bf {
            return self.matmul_bf16(x, bf, w.rows, w.cols, 1);
        }
        CudaTensor::new(x.rows, w.rows, self.gemm_xwt(&x.data, x.rows, x.cols, &w.data, w.rows))
    }

    fn matmul_many(&self, x: &CudaTensor, ws: &[&CudaWeight]) -> Vec<CudaTensor> {
        // The bf16 weights in launches of up to bf16::BFG_MAX products, the rest one by one
        // (all one by one with DSV4_BF16_GROUP=0, the A/B switch).
        let grouped = bf16::group_products();
        let bf: Vec<usize> = (0..ws.len()).filter(|&i| grouped && ws[i].q.is_none() && ws[i].bf.is_some()).collect();
        let mut outs: Vec<Option<CudaTensor>> = ws.iter().map(|_| None).collect();
        for part in bf.chunks(bf16::BFG_MAX).filter(|p| p.len() > 1) {
            let group: Vec<(&CudaSlice<u16>, usize)> = part
                .iter()
                .map(|&i| {
                    assert_eq!(
                        x.cols, ws[i].cols,
                        "matmul: input width {} vs weight [{}, {}]",
                        x.cols, ws[i].rows, ws[i].cols
                    );
                    (ws[i].bf.as_ref().expect("filtered to bf16 weights"), ws[i].rows)
                })
                .collect();
            if let Some(r) = self.matmul_bf16_many(x, &group) {
                for (&i, t) in part.iter().zip(r) {
                    outs[i] = Some(t);
                }
            }
        }
        // Products of packed weights on int8 activations (one row, or 2–4 at two outputs a
        // warp), one launch a format (`set_x8_group`).
        if self.x8_group() {
            let fmt =
                |w: &CudaWeight| w.q.as_ref().filter(|q| self.x8_groupable(x, q, w.rows, w.cols)).map(|q| q.format);
            let mut formats = Vec::new();
            for f in ws.iter().filter_map(|w| fmt(w)) {
                if !formats.contains(&f) {
                    formats.push(f);
                }
            }
            for f in formats {
                let idx: Vec<usize> = (0..ws.len()).filter(|&i| outs[i].is_none() && fmt(ws[i]) == Some(f)).collect();
                for part in idx.chunks(quant::XG_MAX).filter(|p| p.len() > 1) {
                    let group: Vec<_> = part
                        .iter()
                        .map(|&i| (ws[i].q.as_ref().expect("filtered to packed weights"), ws[i].rows))
                        .collect();
                    for (&i, t) in part.iter().zip(self.matmul_x8_many(x, &group)) {
                        outs[i] = Some(t);
                    }
                }
            }
        }
        outs.into_iter().zip(ws).map(|(o, w)| o.unwrap_or_else(|| self.matmul(x, w))).collect()
    }

    fn grouped_matmul(&self, x: &CudaTensor, w: &CudaWeight, groups: usize) -> CudaTensor {
        let inw = x.cols / groups;
        let r = w.rows / groups;
        assert_eq!(w.cols, inw);
        if let Some(q) = &w.q {
            // wo_a: its output is wo_b's input.
            return self.matmul_packed_twin(x, q, w.rows, w.cols, groups, true);
        }
        if let Some(bf) = &w.bf {
            return self.matmul_bf16(x, bf, w.rows, w.cols, groups);
        }
        let mut out = self.tensor(x.rows, groups * r);
        let cfg = StridedBatchedConfig {
            gemm: GemmConfig {
                transa: cublasOperation_t::CUBLAS_OP_T,
                transb: cublasOperation_t::CUBLAS_OP_N,
                m: r as i32,
                n: x.rows as i32,
                k: inw as i32,
                alpha: 1.0f32,
                lda: inw as i32,
                ldb: (groups * inw) as i32,
                beta: 0.0f32,
                ldc: (groups * r) as i32,
            },
            batch_size: groups as i32,
            stride_a: (r * inw) as i64,
            stride_b: inw as i64,
            stride_c: r as i64,
        };
        // SAFETY: group g reads w rows g·r.., x columns g·inw.. and writes out columns g·r...
        self.on_main(|| {
            ck(unsafe { self.blas.gemm_strided_batched(cfg, &w.data, &x.data, &mut out.data) }, "sgemm batched")
        });
        out
    }

    fn rms_norm(&self, x: &CudaTensor, w: Option<&CudaWeight>, group: usize, eps: f32) -> CudaTensor {
        self.norm(x, w, group, eps, None)
    }

    fn rms_norm_rope(
        &self,
        x: &CudaTensor,
        w: Option<&CudaWeight>,
        group: usize,
        eps: f32,
        rows: &CudaRows,
        freqs: &[f64],
    ) -> CudaTensor {
        if group.is_multiple_of(32) && 2 * freqs.len() <= group && self.fusion.norm_rope {
            return self.norm(x, w, group, eps, Some((rows, freqs)));
        }
        let mut y = self.norm(x, w, group, eps, None);
        self.rope(&mut y, rows, freqs, group, false);
        y
    }

    fn norms(&self, jobs: Vec<NormJob<'_, CudaTensor, CudaWeight>>, rows: &CudaRows, freqs: &[f64]) -> Vec<CudaTensor> {
        if self.norm_group() && jobs.len() == 2 && jobs.iter().all(|j| self.norm_job_fits(j, freqs)) {
            return self.norm_many(jobs, rows, freqs);
        }
        crate::backend::norms_apart(self, jobs, rows, freqs)
    }

    fn rope(&self, x: &mut CudaTensor, rows: &CudaRows, freqs: &[f64], head: usize, inverse: bool) {
        let np = freqs.len();
        if np == 0 || x.rows == 0 {
            return;
        }
        let f = self.freqs(freqs);
        let (n, cols) = (x.rows as i32, x.cols as i32);
        if inverse && self.rope_cast_fits(x, head, np) {
            // The attention output's inverse RoPE with the bf16 copy wo_a reads, in one pass.
            let mut xb = self.alloc::<u16>(x.rows * x.cols);
            let lc = LaunchConfig { grid_dim: (x.rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: argument types and sizes match the kernel's signature; xb holds x's
            // rows × cols, both fresh allocations (16-byte aligned), cols a multiple of 8.
            ck(
                unsafe {
                    self.stream()
                        .kernel(&self.k.rope_cast)
                        .arg(x.data_mut())
                        .arg(&mut xb)
                        .arg(rows.dev.as_ref())
                        .arg(&n)
                        .arg(f.as_ref())
                        .arg(&(np as i32))
                        .arg(&cols)
                        .arg(&(head as i32))
                        .arg(&(inverse as i32))
                        .launch(lc)
                },
                "rope_cast",
            );
            let _ = x.bf.set(xb);
            return;
        }
        let lc = cfg1d(x.rows * (x.cols / head) * np, 256);
        // SAFETY: argument types and sizes match the kernel's signature.
        ck(
            unsafe {
                self.stream()
                    .kernel(&self.k.rope)
                    .arg(x.data_mut())
                    .arg(rows.dev.as_ref())
                    .arg(&n)
                    .arg(f.as_ref())
                    .arg(&(np as i32))
                    .arg(&cols)
                    .arg(&(head as i32))
                    .arg(&(inverse as i32))
                    .launch(lc)
            },
            "rope",
        );
    }

    fn add(&self, a: &CudaTensor, b: &CudaTensor) -> CudaTensor {
        assert_eq!((a.rows, a.cols), (b.rows, b.cols));
        let mut out = self.tensor(a.rows, a.cols);
        let len = a.rows * a.cols;
        if len > 0 {
            // SAFETY: argument types and sizes match the kernel's signature.
            ck(
                unsafe {
                    self.stream()
                        .kernel(&self.k.add)
                        .arg(&mut out.data)
                        .arg(&a.data)
                        .arg(&b.data)
                        .arg(&(len as i64))
                        .launch(cfg1d(len, 256))
                },
                "add",
            );
        }
        out
    }

    fn select_rows(&self, x: &CudaTensor, rows: &[usize]) -> CudaTensor {
        let mut out = self.tensor(rows.len(), x.cols);
        if let Some((idx, at)) = self.recorded_out_rows(rows.len()) {
            self.gather(&out, &x.data, &idx.as_ref().slice(at..at + rows.len()), rows.len(), x.cols);
        } else if rows.iter().copied().eq(0..x.rows) {
            ck(self.stream().memcpy_dtod(&x.data.slice(..x.rows * x.cols), &mut out.data), "copy rows");
        } else if !rows.is_empty() {
            let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
            let dev = self.upload_u32(&idx);
            self.gather(&out, &x.data, &dev.slice(..), rows.len(), x.cols);
        }
        out
    }

    fn hc_expand(&self, x: &CudaTensor, n: usize) -> CudaTensor {
        let mut out = self.tensor(x.rows, n * x.cols);
        // SAFETY: argument types and sizes match the kernel's signature.
        ck(
            unsafe {
                self.stream()
                    .kernel(&self.k.hc_expand)
                    .arg(&mut out.data)
                    .arg(&x.data)
                    .arg(&(x.rows as i32))
                    .arg(&(x.cols as i32))
                    .arg(&(n as i32))
                    .launch(cfg1d(x.rows * n * x.cols, 256))
            },
            "hc_expand",
        );
        out
    }

    fn empty(&self, rows: usize, cols: usize) -> CudaTensor {
        self.tensor(rows, cols)
    }

    fn stream_mean_into(&self, out: &mut CudaTensor, col: usize, x: &CudaTensor, n: usize) {
        let d = x.cols / n;
        assert!(x.cols == n * d && out.rows == x.rows && col + d <= out.cols, "stream_mean_into shape");
        if x.rows == 0 {
            return;
        }
        let oc = out.cols as i32;
        // SAFETY: argument types and sizes match the kernel's signature; shapes checked above.
        ck(
            unsafe {
                self.stream()
                    .kernel(&self.k.stream_mean)
                    .arg(out.data_mut())
                    .arg(&x.data)
                    .arg(&(x.rows as i32))
                    .arg(&(d as i32))
                    .arg(&(n as i32))
                    .arg(&oc)
                    .arg(&(col as i32))
                    .launch(cfg1d(x.rows * d, 256))
            },
            "stream_mean",
        );
    }

    fn hc_pre(&self, x: &CudaTensor, hc: &Hc<CudaWeight>, cfg: &Config) -> (CudaTensor, CudaTensor, CudaTensor) {
        let (n, d) = (cfg.hc_mult, cfg.hidden);
        let rows = x.rows;
        let mut y = self.tensor(rows, d);
        let mut post = self.tensor(rows, n);
        let mut comb = self.tensor(rows, n * n);
        if rows == 0 {
            return (y, post, comb);
        }
        let part = self.hc_pre_dot(x, hc, cfg);
        // 256 threads over 1024 columns a block, and one more block for post and the Sinkhorn;
        // mix + 1 ≤ 81 partial sums fit one pass.
        let apply = LaunchConfig {
            grid_dim: (d.div_ceil(1024) as u32 + 1, rows as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument types and sizes match the kernel's signature.
        ck(
            unsafe {
                self.stream()
                    .kernel(&self.k.hc_pre_apply)
                    .arg(&mut y.data)
                    .arg(&mut post.data)
                    .arg(&mut comb.data)
                    .arg(&x.data)
                    .arg(&*part)
                    .arg(&hc.base.data)
                    .arg(&hc.scale.data)
                    .arg(&(n as i32))
                    .arg(&(d as i32))
                    .arg(&(cfg.hc_sinkhorn_iters as i32))
                    .arg(&cfg.rms_eps)
                    .arg(&cfg.hc_eps)
                    .launch(apply)
            },
            "hc_pre_apply",
        );
        (y, post, comb)
    }

    fn hc_pre_norm(
        &self,
        x: &CudaTensor,
        hc: &Hc<CudaWeight>,
        norm: &CudaWeight,
        cfg: &Config,
    ) -> (CudaTensor, CudaTensor, CudaTensor, CudaTensor) {
        let (n, d, rows) = (cfg.hc_mult, cfg.hidden, x.rows);
        let threads = self.norm_threads(d);
        // Prefetch blocks as extra rows of the grid (the blocks of a row: 2, or 1 apart).
        let sink_apart = rows >= HC_DOT_ROWS_MIN && n == 4 && d <= 4 * threads as usize;
        let pf = self.take_l2_ranges(rows, if sink_apart { 1 } else { 2 });
        // The head's partial sums take one thread each.
        if !self.fusion.hc_norm || rows == 0 || threads as usize <= (2 + n) * n {
            let (y, post, comb) = self.hc_pre(x, hc, cfg);
            let a = self.rms_norm(&y, Some(norm), d, cfg.rms_eps);
            return (y, a, post, comb);
        }
        let part = self.hc_pre_dot(x, hc, cfg);
        let (mut y, mut a) = (self.tensor(rows, d), self.tensor(rows, d));
        let (mut post, mut comb) = (self.tensor(rows, n), self.tensor(rows, n * n));
        let twin = self.twin_for(d, d);
        let tw = self.twin_buffers(twin, rows * d);
        let (xq, xd) = tw.as_ref().map_or((&self.dummy_i8, &self.dummy_f32), |t| (&t.q, &t.d));
        // Block 0 of a row: the mix and the norm (rms_norm's block size); block 1: post, comb.
        // Prefill-sized calls with V4's shapes form post and comb in a launch of their own, a
        // warp a row (hc_pre_sink_rows): a sink block held a whole SM for one warp's work.
        let blocks = if sink_apart { 1 } else { 2 };
        for pass in 0..1 + probe_hc_twice() as usize {
            let pf = if pass == 0 { pf } else { L2Ranges::NONE };
            let lc = LaunchConfig {
                grid_dim: (blocks, (rows + pf.layers as usize) as u32, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument types and sizes match the kernel's signature (xq/xd hold the
            // whole norm's codes and scales when `twin`; `pf` is common.cuh's L2Ranges by
            // value, its ranges inside weights that live as long as the model).
            ck(
                unsafe {
                    self.stream()
                        .kernel(&self.k.hc_pre_apply_norm)
                        .arg(&mut y.data)
                        .arg(&mut a.data)
                        .arg(xq)
                        .arg(xd)
                        .arg(&mut post.data)
                        .arg(&mut comb.data)
                        .arg(&x.data)
                        .arg(&*part)
                        .arg(&hc.base.data)
                        .arg(&hc.scale.data)
                        .arg(&norm.data)
                        .arg(&(n as i32))
                        .arg(&(d as i32))
                        .arg(&(cfg.hc_sinkhorn_iters as i32))
                        .arg(&cfg.rms_eps)
                        .arg(&cfg.hc_eps)
                        .arg(&(twin as i32))
                        .arg_struct(&pf)
                        .launch(lc)
                },
                "hc_pre_apply_norm",
            );
        }
        if sink_apart {
            let lc =
                LaunchConfig { grid_dim: (rows.div_ceil(8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: argument types and sizes match the kernel's signature (post: rows · 4,
            // comb: rows · 16 floats; part: hc_pre_dot's [rows, HC_SPLIT, 25]).
            ck(
                unsafe {
                    self.stream()
                        .kernel(&self.k.hc_pre_sink_rows)
                        .arg(&mut post.data)
                        .arg(&mut comb.data)
                        .arg(&*part)
                        .arg(&hc.base.data)
                        .arg(&hc.scale.data)
                        .arg(&(rows as i32))
                        .arg(&(d as i32))
                        .arg(&(cfg.hc_sinkhorn_iters as i32))
                        .arg(&cfg.rms_eps)
                        .arg(&cfg.hc_eps)
                        .launch(lc)
                },
                "hc_pre_sink_rows",
            );
        }
        if let Some(t) = tw {
            let _ = a.x8.set(t);
        }
        (y, a, post, comb)
    }

    fn hc_post(&self, f: &CudaTensor, x: &CudaTensor, post: &CudaTensor, comb: &CudaTensor) -> CudaTensor {
        let (n, d) = (post.cols, f.cols);
        let mut out = self.tensor(x.rows, n * d);
        // Prefill-sized calls: 4 columns a thread in 16-byte accesses (hc.cu's hc_post4, bitwise
        // hc_post's values).
        let wide = x.rows >= HC_DOT_ROWS_MIN && d.is_multiple_of(4);
        let (kernel, cols) = if wide { (&self.k.hc_post4, d / 4) } else { (&self.k.hc_post, d) };
        // SAFETY: argument types and sizes match the kernel's signature.
        ck(
            unsafe {
                self.stream()
                    .kernel(kernel)
                    .arg(&mut out.data)
                    .arg(&f.data)
                    .arg(&x.data)
                    .arg(&post.data)
                    .arg(&comb.data)
                    .arg(&(x.rows as i32))
                    .arg(&(n as i32))
                    .arg(&(d as i32))
                    .launch(LaunchConfig {
                        grid_dim: (cols.div_ceil(128) as u32, x.rows.clamp(1, 65535) as u32, 1),
                        block_dim: (128, 1, 1),
                        shared_mem_bytes: 0,
                    })
            },
            "hc_post",
        );
        out
    }

    fn hc_post_next(
        &self,
        f: &CudaTensor,
        x: &CudaTensor,
        post: &CudaTensor,
        comb: &CudaTensor,
        next: &Hc<CudaWeight>,
        cfg: &Config,
    ) -> CudaTensor {
        let (n, d, rows) = (post.cols, f.cols, x.rows);
        let (mix, width) = ((2 + n) * n, n * d);
        let plain_f32 = next.fn_.bf.is_none() && next.fn_.q.is_none() && (next.fn_.rows, next.fn_.cols) == (mix, width);
        if !self.hc_post_dot()
            || rows == 0
            || n > 8
            || n != cfg.hc_mult
            || !plain_f32
            || !self.hc_dot_plain(rows, n, width)
        {
            return self.hc_post(f, x, post, comb);
        }
        let mut out = self.tensor(rows, width);
        let mut part = self.alloc::<f32>(rows * HC_SPLIT * (mix + 1));
        let lc = hc_dot_grid(rows, mix);
        // SAFETY: argument types and buffer sizes match the kernel's signature: out holds rows ·
        // n · d floats, part rows · HC_SPLIT · (mix + 1), f rows · d, post rows · n, comb rows ·
        // n · n, fn [mix, n · d] (checked above).
        ck(
            unsafe {
                self.stream()
                    .kernel(&self.k.hc_post_dot)
                    .arg(&mut out.data)
                    .arg(&mut part)
                    .arg(&f.data)
                    .arg(&x.data)
                    .arg(&post.data)
                    .arg(&comb.data)
                    .arg(&next.fn_.data)
                    .arg(&(rows as i32))
                    .arg(&(n as i32))
                    .arg(&(d as i32))
                    .arg(&(mix as i32))
                    .launch(lc)
            },
            "hc_post_dot",
        );
        let _ = out.hc_part.set((self.dev_ptr(&next.fn_.data), part));
        out
    }

    fn hc_head(&self, x: &CudaTensor, hc: &Hc<CudaWeight>, cfg: &Config) -> CudaTensor {
        let (n, d) = (cfg.hc_mult, cfg.hidden);
        assert!(n <= 8, "hc_mult {n} > 8");
        let mut y = self.tensor(x.rows, d);
        if x.rows == 0 {
            return y;
        }
        let m = self.matmul(x, &hc.fn_);
        // 1024 threads: the whole n·d row is read twice (ρ, then the mix) by one block.
        let lc = LaunchConfig { grid_dim: (x.rows as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument types and sizes match the kernel's signature.
        ck(
            unsafe {
                self.stream()
                    .kernel(&self.k.hc_head)
                    .arg(&mut y.data)
                    .arg(&x.data)
                    .arg(&m.data)
                    .arg(&hc.base.data)
                    .arg(&hc.scale.data)
                    .arg(&(n as i32))
                    .arg(&(d as i32))
                    .arg(&cfg.rms_eps)
                    .arg(&cfg.hc_eps)
                    .launch(lc)
            },
            "hc_head",
        );
        y
    }

    fn compress(
        &self,
        cache: &mut CudaCache,
        layer: usize,
        slot: CompSlot,
        u: &CudaTensor,
        z: &CudaTensor,
        comp: &Compressor<CudaWeight>,
        rows: &CudaRows,
        freqs: &[f64],
        cfg: &Config,
    ) {
        attention::compress(self, cache, layer, slot, u, z, comp, rows, freqs, cfg);
    }

    fn index_select(
        &self,
        cache: &CudaCache,
        layer: usize,
        qi: &CudaTensor,
        weights: &CudaTensor,
        rows: &CudaRows,
        cfg: &Config,
    ) -> CudaSel {
        attention::index_select(self, cache, layer, qi, weights, rows, cfg)
    }

    fn attention(
        &self,
        cache: &mut CudaCache,
        layer: usize,
        q: &CudaTensor,
        kv: &CudaTensor,
        sel: Option<&CudaSel>,
        sinks: &CudaWeight,
        rows: &CudaRows,
        freqs: &[f64],
        cfg: &Config,
    ) -> CudaTensor {
        attention::attend(self, cache, layer, q, kv, sel, sinks, rows, freqs, cfg)
    }

    fn route(
        &self,
        logits: &CudaTensor,
        bias: Option<&CudaWeight>,
        hash: Option<(&[u32], &CudaRows)>,
        cfg: &Config,
    ) -> CudaRoute {
        moe::route(self, logits, bias, hash, cfg)
    }

    fn router(
        &self,
        x: &CudaTensor,
        gate: &CudaWeight,
        bias: Option<&CudaWeight>,
        hash: Option<(&[u32], &CudaRows)>,
        cfg: &Config,
    ) -> (CudaTensor, CudaRoute) {
        if self.route_fused() && moe::router_fits(self, x, gate) {
            return moe::router_fused(self, x, gate, bias, hash, cfg);
        }
        let logits = self.matmul(x, gate);
        let route = moe::route(self, &logits, bias, hash, cfg);
        (logits, route)
    }

    fn moe(
        &self,
        x: &CudaTensor,
        route: &CudaRoute,
        experts: &[Expert<CudaWeight>],
        first: usize,
        limit: f32,
    ) -> CudaTensor {
        moe::moe(self, x, route, experts, first, limit)
    }

    fn swiglu(&self, x: &CudaTensor, e: &Expert<CudaWeight>, limit: f32) -> CudaTensor {
        if let Some(y) = self.fusion.shared_x8.then(|| bf16::shared_expert_x8(self, x, e, limit)).flatten() {
            return y;
        }
        let g = self.matmul(x, &e.w1);
        let u = self.matmul(x, &e.w3);
        let mut h = self.tensor(g.rows, g.cols);
        let len = g.rows * g.cols;
        // SAFETY: argument types and sizes match the kernel's signature.
        ck(
            unsafe {
                self.stream()
                    .kernel(&self.k.swiglu_act)
                    .arg(&mut h.data)
                    .arg(&g.data)
                    .arg(&u.data)
                    .arg(&(len as i64))
                    .arg(&limit)
                    .launch(cfg1d(len, 256))
            },
            "swiglu_act",
        );
        self.matmul(&h, &e.w2)
    }

    fn moe_shared(
        &self,
        x: &CudaTensor,
        route: &CudaRoute,
        experts: &[Expert<CudaWeight>],
        first: usize,
        shared: &Expert<CudaWeight>,
        limit: f32,
    ) -> (CudaTensor, CudaTensor, CudaTensor) {
        if let Some(r) =
            self.ffn1().then(|| bf16::ffn_few_rows(self, x, route, experts, first, shared, limit)).flatten()
        {
            return r;
        }
        crate::backend::moe_shared_apart(self, x, route, experts, first, shared, limit)
    }

    fn reset_probes(&self, cache: &mut CudaCache) {
        ck(self.stream().memset_zeros(&mut cache.probes), "reset probes");
    }

    fn probe_finite(&self, cache: &mut CudaCache, t: &CudaTensor, slot: usize) {
        bf16::probe(self, cache, t, slot);
    }

    fn read_probes(&self, cache: &CudaCache, n: usize) -> Vec<Option<usize>> {
        let v = ck(self.main_stream().clone_dtoh(&cache.probes), "read probes");
        ck(self.stream().synchronize(), "synchronize");
        (0..n).map(|i| v.get(i).and_then(|&f| (f != 0).then(|| (u32::MAX - f) as usize))).collect()
    }

    fn graph_max_rows(&self, cfg: &Config) -> usize {
        graph::graph_max_rows(self.exact(), cfg.hidden, cfg.moe_inter)
    }

    fn prepare_step(
        &self,
        cache: &mut CudaCache,
        batch: &Batch,
        out_rows: &[usize],
        draws: &[crate::draw::Draw],
        cols: usize,
        hidden_cols: usize,
    ) -> u64 {
        CudaBackend::prepare_step(self, cache, batch, out_rows, draws, cols, hidden_cols)
    }

    fn begin_record(&self, rows: usize, out: usize, hidden_cols: usize) -> bool {
        CudaBackend::begin_record(self, rows, out, hidden_cols)
    }

    fn end_record(&self, logits: CudaTensor, hidden: Option<CudaTensor>) -> Result<graph::StepGraph, String> {
        CudaBackend::end_record(self, logits, hidden)
    }

    fn replay(&self, g: &graph::StepGraph) {
        CudaBackend::replay(self, g)
    }

    fn graph_kernels(&self, g: &graph::StepGraph) -> usize {
        g.kernels
    }

    fn step_output(&self, g: &graph::StepGraph, logits: usize) -> crate::backend::StepResult {
        CudaBackend::step_output(self, g, logits)
    }

    fn to_device(&self, rows: usize, cols: usize, data: &[f32]) -> CudaTensor {
        dspark::to_device(self, rows, cols, data)
    }

    fn scatter_rows(&self, dst: &mut CudaTensor, src: &CudaTensor, dst_rows: &[usize]) {
        dspark::scatter_rows(self, dst, src, dst_rows)
    }

    fn block_attention(
        &self,
        q: &CudaTensor,
        kb: &CudaTensor,
        rings: &[&CudaTensor],
        slots: &[Vec<usize>],
        sinks: &CudaWeight,
        heads: usize,
    ) -> CudaTensor {
        dspark::block_attention(self, q, kb, rings, slots, sinks, heads)
    }

    fn argmax_rows(&self, x: &CudaTensor) -> Vec<u32> {
        dspark::argmax_rows(self, x)
    }

    fn argmax_ids(&self, x: &CudaTensor) -> CudaIds {
        CudaIds { dev: dspark::argmax_ids(self, x), n: x.rows }
    }

    fn upload_ids(&self, ids: &[u32]) -> CudaIds {
        CudaIds { dev: self.upload_u32(ids), n: ids.len() }
    }

    fn embed_ids(&self, table: &CudaWeight, ids: &CudaIds) -> CudaTensor {
        self.embed_view(table, &ids.dev.slice(..ids.n), ids.n)
    }

    fn ids_to_host(&self, ids: &CudaIds) -> Vec<u32> {
        if ids.n == 0 {
            return Vec::new();
        }
        let v = ck(self.stream().clone_dtoh(&ids.dev.slice(..ids.n)), "download ids");
        ck(self.stream().synchronize(), "synchronize");
        v
    }

    fn markov_argmax(
        &self,
        u: &CudaTensor,
        rows: &[usize],
        prev: &CudaIds,
        w1: &CudaWeight,
        w2: &CudaWeight,
    ) -> CudaIds {
        match dspark::markov_argmax(self, u, rows, prev, w1, w2) {
            Some(dev) => CudaIds { dev, n: rows.len() },
            None => crate::backend::markov_argmax_ops(self, u, rows, prev, w1, w2),
        }
    }

    fn concat_ids(&self, parts: &[&CudaIds]) -> CudaIds {
        let n = parts.iter().map(|p| p.n).sum();
        let mut dev = self.alloc::<u32>(n);
        let mut at = 0;
        for p in parts.iter().filter(|p| p.n > 0) {
            let mut dst = dev.slice_mut(at..at + p.n);
            ck(self.stream().memcpy_dtod(&p.dev.slice(..p.n), &mut dst), "concatenate ids");
            at += p.n;
        }
        CudaIds { dev, n }
    }

    fn draw_rows(&self, x: &CudaTensor, draws: &[crate::draw::Draw]) -> Vec<u32> {
        draw::draw_rows(self, x, draws)
    }
}

impl CudaBackend {
    /// `out[i, :] = src[idx[i], :]`.
    fn gather(
        &self,
        out: &CudaTensor,
        src: &CudaSlice<f32>,
        idx: &cudarc::driver::CudaView<'_, u32>,
        n: usize,
        cols: usize,
    ) {
        // SAFETY: argument types and sizes match the kernel's signature.
        ck(
            unsafe {
                self.stream()
                    .kernel(&self.k.gather_rows)
                    .arg(&out.data)
                    .arg(src)
                    .arg(idx)
                    .arg(&(n as i32))
                    .arg(&(cols as i32))
                    .launch(cfg1d(n * cols, 256))
            },
            "gather_rows",
        );
    }
}

#[cfg(test)]
mod tests {
    use super::{
        cubin_path, decode_fusion_in, elf_is_whole, prune_ptx, ptx_key, side_mask_in, store_ptx, touch, HostVecs,
        HOST_VECS_KEEP, HOST_VECS_MIN,
    };

    #[test]
    fn kept_ptx_names_hash_every_part_and_its_length() {
        let k = ptx_key(&[b"quant.cu", b"src", b"compute_90a", &[1]]);
        assert_eq!(k, ptx_key(&[b"quant.cu", b"src", b"compute_90a", &[1]]), "stable");
        assert_ne!(k, ptx_key(&[b"quant.cu", b"src", b"compute_90a", &[0]]), "the options count");
        assert_ne!(k, ptx_key(&[b"quant.cu", b"srd", b"compute_90a", &[1]]), "the source counts");
        assert_ne!(ptx_key(&[b"ab", b"c"]), ptx_key(&[b"a", b"bc"]), "parts do not run together");
        // FNV-1a 128 of the empty input with no parts: its offset basis.
        assert_eq!(ptx_key(&[]), 0x6c62272e07bb014262b821756295c58d);
    }

    #[test]
    fn kept_ptx_is_written_whole_into_a_new_folder() {
        let dir = std::env::temp_dir().join(format!("dsv4-ptx-test-{}", std::process::id()));
        let path = dir.join("sub").join("x.cu-00.ptx");
        store_ptx(&path, "// ptx");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "// ptx");
        let left: Vec<_> = std::fs::read_dir(path.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, vec![std::ffi::OsString::from("x.cu-00.ptx")], "no temporary file left");
        // The newest `keep` of a kernel file's PTX stay; another file's are not touched.
        for i in 1..=3 {
            std::thread::sleep(std::time::Duration::from_millis(20));
            store_ptx(&path.with_file_name(format!("x.cu-0{i}.ptx")), "// ptx");
        }
        store_ptx(&path.with_file_name("y.cu-00.ptx"), "// ptx");
        // A pruned PTX takes its cubin with it; a kept one keeps it.
        for n in ["x.cu-00.ptx", "x.cu-03.ptx"] {
            std::fs::write(cubin_path(&path.with_file_name(n)), b"cubin").unwrap();
        }
        prune_ptx(&path, "x.cu", 2);
        let mut left: Vec<_> =
            std::fs::read_dir(path.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
        left.sort();
        assert_eq!(
            left,
            ["x.cu-02.ptx", "x.cu-03.ptx", "x.cu-03.sm_90a.cubin", "y.cu-00.ptx"].map(std::ffi::OsString::from)
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_kept_ptx_used_again_outlives_newer_ones_when_pruned() {
        let dir = std::env::temp_dir().join(format!("dsv4-ptx-lru-{}", std::process::id()));
        let path = dir.join("x.cu-00.ptx");
        for i in 0..3 {
            std::thread::sleep(std::time::Duration::from_millis(20));
            store_ptx(&path.with_file_name(format!("x.cu-0{i}.ptx")), "// ptx");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        touch(&path);
        prune_ptx(&path, "x.cu", 2);
        let mut left: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        left.sort();
        assert_eq!(left, ["x.cu-00.ptx", "x.cu-02.ptx"].map(std::ffi::OsString::from));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A 64-bit little-endian ELF image: the header, 16 bytes of contents, then two section
    /// headers (the contents, and a NOBITS section larger than the file).
    fn small_elf() -> Vec<u8> {
        let mut b = vec![0u8; 64];
        b[..4].copy_from_slice(b"\x7fELF");
        (b[4], b[5]) = (2, 1);
        b[0x28..0x30].copy_from_slice(&80u64.to_le_bytes());
        b[0x3A..0x3C].copy_from_slice(&64u16.to_le_bytes());
        b[0x3C..0x3E].copy_from_slice(&2u16.to_le_bytes());
        b.extend([7u8; 16]);
        for (ty, off, size) in [(1u32, 64u64, 16u64), (8, 0, 1 << 40)] {
            let mut h = [0u8; 64];
            h[4..8].copy_from_slice(&ty.to_le_bytes());
            h[0x18..0x20].copy_from_slice(&off.to_le_bytes());
            h[0x20..0x28].copy_from_slice(&size.to_le_bytes());
            b.extend(h);
        }
        b
    }

    #[test]
    fn only_a_whole_elf_image_goes_to_the_driver() {
        let elf = small_elf();
        assert!(elf_is_whole(&elf));
        for cut in [0, 3, 63, 64, 79, 80, 143, elf.len() - 1] {
            assert!(!elf_is_whole(&elf[..cut]), "cut at {cut} of {}", elf.len());
        }
        assert!(!elf_is_whole(
            b"//\n// Generated by NVIDIA NVVM Compiler\n.version 8.8\n.target sm_90a\n.address_size 64\n"
        ));
        // A section whose contents run past the end of the file.
        let mut past = elf.clone();
        past[80 + 0x20..80 + 0x28].copy_from_slice(&(elf.len() as u64 - 63).to_le_bytes());
        assert!(!elf_is_whole(&past));
        // A 32-bit ELF.
        let mut e32 = elf;
        e32[4] = 1;
        assert!(!elf_is_whole(&e32));
    }

    #[test]
    fn a_host_vector_given_back_serves_the_next_download_of_its_size_or_less() {
        let pool = HostVecs::default();
        let fresh = pool.take(10);
        assert_eq!(fresh.len(), 10);
        pool.give(fresh);
        assert!(pool.0.lock().unwrap().is_empty(), "a small vector is not kept: the heap serves those");
        let big = pool.take(HOST_VECS_MIN + 5);
        let at = big.as_ptr();
        pool.give(big);
        let again = pool.take(HOST_VECS_MIN);
        assert_eq!((again.as_ptr(), again.len()), (at, HOST_VECS_MIN), "the same pages, at the length asked");
        pool.give(again);
        let larger = pool.take(HOST_VECS_MIN + 6);
        assert_ne!(larger.as_ptr(), at, "too small for it: a new vector");
        assert_eq!(larger.len(), HOST_VECS_MIN + 6);
        // Past HOST_VECS_KEEP, the smallest kept one goes.
        for extra in 0..HOST_VECS_KEEP {
            pool.give(Vec::with_capacity(HOST_VECS_MIN + 100 * (extra + 1)));
        }
        let kept: Vec<usize> = pool.0.lock().unwrap().iter().map(|v| v.capacity()).collect();
        assert_eq!(kept.len(), HOST_VECS_KEEP);
        assert!(kept.iter().all(|&c| c >= HOST_VECS_MIN + 100), "the smallest went: {kept:?}");
        drop(larger);
    }

    #[test]
    fn a_switch_of_its_own_wins_over_all_fusions() {
        let on = |vars: &[(&str, &str)], name: &str| {
            decode_fusion_in(name, |n| vars.iter().find(|(k, _)| *k == n).map(|(_, v)| v.to_string()))
        };
        assert!(on(&[], "DSV4_FFN1"), "on by default");
        assert!(!on(&[], "DSV4_HC_POST_DOT"), "HC_POST_DOT off by default");
        assert!(!on(&[("DSV4_FFN1", "0")], "DSV4_FFN1"));
        assert!(on(&[("DSV4_FFN1", "0")], "DSV4_GEMV4"), "one switch turns off only itself");
        assert!(on(&[("DSV4_HC_POST_DOT", "1")], "DSV4_HC_POST_DOT"));
        assert!(!on(&[("DSV4_DECODE_FUSIONS", "0")], "DSV4_FFN1"), "the umbrella turns them all off");
        assert!(on(&[("DSV4_DECODE_FUSIONS", "1")], "DSV4_GEMV4"));
        assert!(!on(&[("DSV4_DECODE_FUSIONS", "1"), ("DSV4_GEMV4", " 0 ")], "DSV4_GEMV4"));
        assert!(on(&[("DSV4_DECODE_FUSIONS", "0"), ("DSV4_GEMV4", "1")], "DSV4_GEMV4"));
        // Anything but 1 or 0 says nothing: the umbrella decides.
        assert!(on(&[("DSV4_DECODE_FUSIONS", "1"), ("DSV4_FFN1", "")], "DSV4_FFN1"));
        assert!(on(&[("DSV4_FFN1", "true")], "DSV4_FFN1"), "not a 1/0: the default");
        assert!(!on(&[("DSV4_HC_POST_DOT", "yes")], "DSV4_HC_POST_DOT"));
    }

    /// `DSV4_SIDE`: the compressors' branch by default, masks of the two branches as given, and
    /// anything else (bit 4's removed branch among them) all off rather than a partial mask.
    #[test]
    fn side_mask_takes_the_two_branches_and_refuses_the_rest() {
        assert_eq!(side_mask_in(None), 1, "the compressors' branch by default");
        for (v, m) in [("0", 0), ("1", 1), ("2", 2), (" 3 ", 3)] {
            assert_eq!(side_mask_in(Some(v)), m, "DSV4_SIDE={v:?}");
        }
        for v in ["4", "5", "7", "8", "-1", "", "on"] {
            assert_eq!(side_mask_in(Some(v)), 0, "DSV4_SIDE={v:?}: off");
        }
    }
}
