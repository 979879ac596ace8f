//! Launchers of `kernels/bf16.cu`: products with bf16 weights, the grouped routed experts, the
//! nonfinite probe and on-device random weights.
//!
//! A product with at most [`gemv_rows`] rows (decode) runs `gemvt_bf16` (tensor cores,
//! activations rounded to bf16, f32 accumulation; `gemvt16_bf16`, the same sums with fewer
//! loads in flight, above 8 rows), and in exact mode (any row count) the `gemv_bf16` kernel: f32
//! activations, bf16 weights read once with 16-byte loads, f32 accumulation. Both sum each row
//! in one order whatever the row count. Larger products cast the activations to bf16 and run
//! cuBLAS `gemmEx` (bf16 inputs, f32 compute and output). Routed experts: the (row, slot) pairs are grouped by expert
//! on the device; up to [`grouped_max_rows`] rows (or in exact mode) one launch each for the
//! up and down projections (`quant.cu`, where bf16 is one of the formats) covers every active
//! expert with no host synchronisation; above
//! that the expert offsets are read back (one sync per MoE layer) and each active expert runs
//! two cuBLAS bf16 products over its gathered rows.

use super::launch::{Kernel, KernelStruct};
use super::quant::Q_WARPS;
use super::{cfg1d, ck, CudaBackend, CudaCache, CudaRoute, CudaTensor, CudaWeight};
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::{CudaFunction, CudaSlice, CudaView, DevicePtrMut, LaunchConfig};
use dsv4_model::weights::Expert;
use std::ffi::c_void;

/// Largest row count of a dense product on bf16 or f32 weights that uses the batch-invariant
/// kernels (`gemvt_bf16`, `gemv_bf16`, `gemv_f32`), whose every row's sum has one order whatever
/// the row count: up to here a row's result does not depend on its batch (cuBLAS above picks
/// its kernel by shape).
/// Serving steps of up to 16 rows (`--token-budget 16`, batch 16 decode) stay invariant.
pub const GEMV_ROWS: usize = 16;

/// [`GEMV_ROWS`], or `DSV4_GEMV_ROWS` (A/B of the invariant kernels against cuBLAS).
pub fn gemv_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| std::env::var("DSV4_GEMV_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(GEMV_ROWS))
}

/// Whether the fast-mode bf16 products of at most 8 rows take `gemvtp_bf16` (the same bits,
/// the next k blocks' weights loading while the current ones' mma run) instead of
/// `gemvt_bf16`: `DSV4_GEMVT_PIPE=1`. Every such product (in the q2 model the compressor and
/// indexer projections, in a bf16 model all of them) then holds 118 registers a thread instead
/// of 80 (2 blocks an SM instead of 3). Off by default (PERF.md v26: the q2 decode's compressor
/// and indexer products ran at 1.7 TB/s, about one block an SM; pipelined, −3 % on an H100,
/// within a step's spread).
pub(crate) fn gemvt_pipe() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("DSV4_GEMVT_PIPE").is_ok_and(|v| v.trim() == "1"))
}

/// Whether `moe_down1s` runs blocks of one warp a pair (k + 1 = 7 warps for V4: none idle) or of
/// Q_WARPS warps (the built-in, one idle at k = 6): `DSV4_DOWN1_PAIRS=1`. The same values (the
/// kernel's warps past the pairs form nothing). At one output a warp (64 registers) both hold 4
/// blocks an SM, so it moved nothing (PERF.md v44, v49's dn5bp); at the default 4 (128 registers,
/// 2 blocks an SM) it has not been timed.
fn down1_pair_warps() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("DSV4_DOWN1_PAIRS").is_ok_and(|v| v.trim() == "1"))
}

/// Whether a plain (one-group) bf16 product of `n` rows and `k` inputs on `b` runs the fast-mode
/// tiles (`gemvt_bf16` / `gemvt16_bf16` / `gemvtp_bf16`: the same sums), as
/// [`CudaBackend::matmul_bf16`] and `gemv` choose: the Markov slot's fused kernel forms those sums.
pub(crate) fn tiles_take(b: &CudaBackend, n: usize, k: usize) -> bool {
    n <= gemv_rows() && !b.exact() && gemv_tiles() && k.is_multiple_of(32)
}

/// Whether fast-mode bf16 products of up to [`gemv_rows`] rows take `gemvt_bf16` (default) or,
/// with `DSV4_BF16_TILES=0`, the f32-activation GEMV kernels (both batch invariant).
fn gemv_tiles() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("DSV4_BF16_TILES").map(|v| v != "0").unwrap_or(true))
}

/// Whether [`crate::Backend::matmul_many`] runs the bf16 products of one input in one launch
/// (default) or, with `DSV4_BF16_GROUP=0`, one launch each (the same results).
pub(crate) fn group_products() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("DSV4_BF16_GROUP").map(|v| v != "0").unwrap_or(true))
}

/// Whether an activation's bf16 cast is kept on its tensor for the next product
/// (`DSV4_BF16_CACHE`, default on).
pub(crate) fn keep_bf16() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("DSV4_BF16_CACHE").map(|v| v != "0").unwrap_or(true))
}

/// A product's bf16 activations: the tensor's kept cast, or one made for this product.
pub(crate) enum BfInput<'a> {
    Kept(&'a CudaSlice<u16>),
    Fresh(CudaSlice<u16>),
}

impl std::ops::Deref for BfInput<'_> {
    type Target = CudaSlice<u16>;
    fn deref(&self) -> &CudaSlice<u16> {
        match self {
            BfInput::Kept(s) => s,
            BfInput::Fresh(s) => s,
        }
    }
}

/// `BFG_MAX` of bf16.cu: products one bf16 launch takes at most.
pub(crate) const BFG_MAX: usize = 8;

/// `BfGroup` of bf16.cu: the products of one launch (weights, outputs and their shapes) and the
/// first block of each, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct BfGroup {
    w: [u64; BFG_MAX],
    out: [u64; BFG_MAX],
    m: [i32; BFG_MAX],
    rpg: [i32; BFG_MAX],
    b0: [i32; BFG_MAX + 1],
    count: i32,
}

// SAFETY: #[repr(C)] integers in bf16.cu's field order (8-byte pointers first, then 4-byte
// ints: 8·8 + 8·8 + 4·(8 + 8 + 9 + 1) = 232 bytes, no padding), as the kernels declare it.
unsafe impl KernelStruct for BfGroup {}

/// One product of a grouped bf16 launch.
struct BfEntry<'a> {
    out: &'a mut CudaSlice<f32>,
    w: &'a CudaSlice<u16>,
    m: usize,
    rpg: usize,
}

/// Largest row count of a MoE call that uses the grouped expert kernels in fast mode (exact mode
/// uses them at any row count), by default: past it the tensor-core tiles (`pgemm_experts`).
/// With 80 and 128 decode rows (4 q2 layers, H100, PERF.md v36) the grouped kernels took 10.4
/// and 14.5 ms a step where the tiles took 17.2 and 19.6; at 32 and 64 rows the tiles lost
/// (11.0 and 15.2 against 5.4 and 8.5 ms).
pub const GROUPED_MAX_ROWS: usize = 128;

/// The most blocks a launch's grid takes in y (CUDA's limit); kernels that split rows over y
/// stride past it.
pub(crate) const GRID_Y_MAX: usize = 65535;

/// [`GROUPED_MAX_ROWS`], or `DSV4_GROUPED_MAX_ROWS` where set (at most the recorded steps'
/// largest; read once), for A/B runs.
pub fn grouped_max_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| {
        std::env::var("DSV4_GROUPED_MAX_ROWS")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .map_or(GROUPED_MAX_ROWS, |r: usize| r.min(super::graph::GRAPH_MAX_ROWS))
    })
}

impl CudaBackend {
    /// `out[n, m] = x · wᵀ` for a bf16 `w` `[m, k]`; with `groups > 1` the grouped projection
    /// of [`crate::Backend::grouped_matmul`] (`x` is `groups·k` wide).
    pub(crate) fn matmul_bf16(
        &self,
        x: &CudaTensor,
        w: &CudaSlice<u16>,
        m: usize,
        k: usize,
        groups: usize,
    ) -> CudaTensor {
        let n = x.rows;
        assert_eq!(x.cols, groups * k, "bf16 product: input width {} vs {groups} × {k}", x.cols);
        let mut out = self.tensor(n, m);
        if n == 0 || m == 0 {
            return out;
        }
        if n <= gemv_rows() || self.exact() {
            self.gemv(&x.data, n, k, x.cols, &mut [BfEntry { out: &mut out.data, w, m, rpg: m / groups }]);
            return out;
        }
        let xb = self.bf16_of(x);
        let r = m / groups;
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: column-major outᵀ[m', n] = w_gᵀ · xb_gᵀ per group; the shapes, leading
        // dimensions and strides match the buffers' lengths.
        self.on_main(|| unsafe {
            let (wp, xp, op) = (self.dev_ptr(w), self.dev_ptr(&*xb), self.dev_ptr(&out.data));
            let r = cudarc::cublas::result::gemm_strided_batched_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                r as i32,
                n as i32,
                k as i32,
                &alpha as *const f32 as *const c_void,
                wp as *const c_void,
                cudaDataType::CUDA_R_16BF,
                k as i32,
                (r * k) as i64,
                xp as *const c_void,
                cudaDataType::CUDA_R_16BF,
                (groups * k) as i32,
                k as i64,
                &beta as *const f32 as *const c_void,
                op as *mut c_void,
                cudaDataType::CUDA_R_32F,
                m as i32,
                r as i64,
                groups as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            );
            ck(r, "gemmEx bf16");
        });
        out
    }

    /// The products `x · w_iᵀ` of one input with several bf16 weights `[m_i, k]`, in one launch
    /// where the GEMV kernels serve the row count (decode, and exact mode at any count): the
    /// compressor's and indexer's projections of an attention input, 64–1,024 outputs each, ran
    /// 4–64 blocks a launch alone. `None` where they don't (cuBLAS sizes): call them one by one.
    pub(crate) fn matmul_bf16_many(&self, x: &CudaTensor, ws: &[(&CudaSlice<u16>, usize)]) -> Option<Vec<CudaTensor>> {
        let n = x.rows;
        let k = x.cols;
        if n == 0 || ws.len() > BFG_MAX || !(n <= gemv_rows() || self.exact()) {
            return None;
        }
        let mut outs: Vec<CudaTensor> = ws.iter().map(|&(_, m)| self.tensor(n, m)).collect();
        let mut entries: Vec<BfEntry> =
            outs.iter_mut().zip(ws).map(|(o, &(w, m))| BfEntry { out: &mut o.data, w, m, rpg: m }).collect();
        self.gemv(&x.data, n, k, k, &mut entries);
        Some(outs)
    }

    /// `out_i[n, m_i]` (row stride m_i) `= x[r, g(o)·k..] · w_i[o, :]` with `g(o) = o / rpg_i`,
    /// every entry in one launch: the GEMV kernels (f32 activations; any row count, rows in
    /// groups of 8), or in fast mode `gemvt_bf16` (tensor cores, activations rounded to bf16, 16
    /// rows a tile) where the shapes allow: k a multiple of 32, a tile's 16 outputs in one group.
    /// A block computes the same sums whatever entries share its launch.
    fn gemv(&self, x: &CudaSlice<f32>, n: usize, k: usize, ldx: usize, entries: &mut [BfEntry]) {
        assert!(!entries.is_empty() && entries.len() <= BFG_MAX, "{} bf16 products in one launch", entries.len());
        let tiles = !self.exact()
            && gemv_tiles()
            && k.is_multiple_of(32)
            && ldx.is_multiple_of(4)
            && entries.iter().all(|e| e.rpg == e.m || e.rpg.is_multiple_of(16));
        // Outputs a block takes: a 16-output tile, or 8 warps of one output each.
        let per = if tiles { 16 } else { 8 };
        let mut g = BfGroup::default();
        let mut blocks = 0usize;
        for (i, e) in entries.iter().enumerate() {
            g.w[i] = self.dev_ptr(e.w);
            g.out[i] = self.dev_ptr(e.out);
            g.m[i] = e.m as i32;
            g.rpg[i] = e.rpg as i32;
            g.b0[i] = blocks as i32;
            blocks += e.m.div_ceil(per);
        }
        g.b0[entries.len()] = blocks as i32;
        g.count = entries.len() as i32;
        if blocks == 0 {
            return;
        }
        let f = match (tiles, n) {
            (true, n) if n > 8 => &self.k.gemvt16_bf16,
            (true, _) if gemvt_pipe() => &self.k.gemvtp_bf16,
            (true, _) => &self.k.gemvt_bf16,
            (false, 1) => &self.k.gemv1_bf16,
            (false, _) => &self.k.gemv_bf16,
        };
        // The tiles: a block per 16 rows; the GEMV kernels: a block per group of 8 rows.
        let ys = if tiles { n.div_ceil(16) } else { n.div_ceil(8) };
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, ys.min(GRID_Y_MAX) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument types match the kernel (BfGroup is bf16.cu's struct); entry i's
        // weight holds m_i·k values and its output n·m_i, and x holds n rows of ldx.
        ck(
            unsafe {
                self.stream()
                    .kernel(f)
                    .arg_struct(&g)
                    .arg(x)
                    .arg(&(n as i32))
                    .arg(&(k as i32))
                    .arg(&(ldx as i32))
                    .launch(cfg)
            },
            "gemv_bf16",
        );
    }

    /// `x`'s values rounded to bf16, cast once and kept on the tensor ([`CudaTensor::bf`]);
    /// cast for this product alone with `DSV4_BF16_CACHE=0` (the A/B switch).
    pub(crate) fn bf16_of<'a>(&self, x: &'a CudaTensor) -> BfInput<'a> {
        if keep_bf16() {
            let made_here = x.bf.get().is_none();
            let xb = x.bf.get_or_init(|| self.cast_bf16(&x.data, x.rows * x.cols));
            if made_here {
                // Kept with `x`, which the main chain may read before a side branch's join.
                self.side_fence();
            }
            BfInput::Kept(xb)
        } else {
            BfInput::Fresh(self.cast_bf16(&x.data, x.rows * x.cols))
        }
    }

    pub(crate) fn cast_bf16(&self, x: &CudaSlice<f32>, len: usize) -> CudaSlice<u16> {
        let mut out = self.alloc::<u16>(len);
        // SAFETY: argument types and buffer sizes match the kernel.
        ck(
            unsafe {
                self.stream()
                    .kernel(&self.k.cast_bf16)
                    .arg(&mut out)
                    .arg(x)
                    .arg(&(len as i64))
                    .launch(cfg1d(len.div_ceil(8), 256))
            },
            "cast_bf16",
        );
        out
    }

    /// One cuBLAS product `c[n, m] = a[n, k] · w[m, k]ᵀ`, bf16 inputs and f32 output, on raw
    /// device addresses (inside larger buffers).
    fn gemm_bf16_raw(&self, c: u64, a: u64, w: u64, n: usize, k: usize, m: usize) {
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the callers pass addresses of buffers holding these shapes.
        self.on_main(|| unsafe {
            let r = cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                &alpha as *const f32 as *const c_void,
                w as *const c_void,
                cudaDataType::CUDA_R_16BF,
                k as i32,
                a as *const c_void,
                cudaDataType::CUDA_R_16BF,
                k as i32,
                &beta as *const f32 as *const c_void,
                c as *mut c_void,
                cudaDataType::CUDA_R_32F,
                m as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            );
            ck(r, "gemmEx bf16");
        })
    }

    /// A new weight of `shape` filled on the device with Normal(mean, std) (seeded by `seed`),
    /// stored bf16 when this backend would store a loaded tensor `name` so.
    pub fn upload_random(&self, name: &str, shape: &[usize], mean: f32, std: f32, seed: u64) -> CudaWeight {
        let (rows, cols) = match shape {
            [c] => (1, *c),
            [r, c] => (*r, *c),
            _ => panic!("{name}: rank {}", shape.len()),
        };
        let len = rows * cols;
        let bf = self.bf16 && crate::bf16::is_bf16_weight(name, shape);
        let cfg = cfg1d(len, 256);
        let launch = |ptr: u64| {
            // SAFETY: `ptr` holds `len` elements of the kind `bf` says.
            ck(
                unsafe {
                    self.stream()
                        .kernel(&self.k.rand_normal)
                        .arg(&ptr)
                        .arg(&(bf as i32))
                        .arg(&(len as i64))
                        .arg(&mean)
                        .arg(&std)
                        .arg(&seed)
                        .launch(cfg)
                },
                "rand_normal",
            )
        };
        // The dense products read their first weight bytes before waiting for the kernel before
        // them (PDL): each weight is complete (synchronised) before any kernel can read it.
        if bf {
            let w = self.alloc::<u16>(len);
            launch(self.dev_ptr(&w));
            self.synchronize();
            CudaWeight { rows, cols, data: self.alloc(1), bf: Some(w), q: None }
        } else {
            let w = self.alloc::<f32>(len);
            launch(self.dev_ptr(&w));
            self.synchronize();
            CudaWeight { rows, cols, data: w, bf: None, q: None }
        }
    }

    /// Free device memory in bytes.
    pub fn mem_free(&self) -> usize {
        cudarc::driver::result::mem_get_info().map(|(f, _)| f).unwrap_or(0)
    }

    /// A timing event recorded on the stream now (profiling: `elapsed_ms` between two).
    pub fn timing_event(&self) -> cudarc::driver::CudaEvent {
        let e = ck(self.ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)), "event");
        ck(e.record(self.stream()), "record");
        e
    }

    /// Starts (`true`) or stops the profiler's capture (ncu `--profile-from-start off`), so a
    /// profile can hold one decode step and not the weight draw and prefill before it.
    pub fn profiler_capture(&self, on: bool) {
        self.synchronize();
        ck(self.ctx.bind_to_thread(), "bind context");
        // SAFETY: neither call takes arguments; the backend's context is current on this thread
        // (bound above) and its stream is idle (synchronised above).
        let r = unsafe {
            if on {
                cudarc::driver::sys::cuProfilerStart()
            } else {
                cudarc::driver::sys::cuProfilerStop()
            }
        };
        ck(r.result(), "profiler capture");
    }

    /// A bf16 or f32 weight's values on the host (bf16 widened exactly).
    pub fn download_weight_f32(&self, w: &CudaWeight) -> Vec<f32> {
        let v = match &w.bf {
            Some(bf) => ck(self.stream().clone_dtoh(bf), "download")
                .into_iter()
                .map(|h| f32::from_bits((h as u32) << 16))
                .collect(),
            None => ck(self.stream().clone_dtoh(&w.data), "download"),
        };
        self.synchronize();
        v
    }

    /// Total device memory in bytes.
    pub fn mem_total(&self) -> usize {
        cudarc::driver::result::mem_get_info().map(|(_, t)| t).unwrap_or(0)
    }
}

pub(crate) fn probe(b: &CudaBackend, cache: &mut CudaCache, t: &CudaTensor, slot: usize) {
    assert!(slot < cache.probes.len(), "probe slot {slot} beyond {}", cache.probes.len());
    probe_into(b, &mut cache.probes, slot, &t.data, t.rows * t.cols, t.cols);
}

/// Queues `flags[slot] = max(flags[slot], 0xffffffff − first row of `x` holding a NaN/±∞)`
/// over the first `len` values of `x` (rows of `cols`).
pub(crate) fn probe_into(
    b: &CudaBackend,
    flags: &mut CudaSlice<u32>,
    slot: usize,
    x: &CudaSlice<f32>,
    len: usize,
    cols: usize,
) {
    if len == 0 {
        return;
    }
    // Two float4 loads a thread in flight: 132 SMs × 8 blocks of 256.
    let blocks = len.div_ceil(4 * 256).clamp(1, 1056) as u32;
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: argument types and buffer sizes match the kernel.
    ck(
        unsafe {
            b.stream()
                .kernel(&b.k.probe_finite)
                .arg(flags)
                .arg(&(slot as i32))
                .arg(x)
                .arg(&(len as i64))
                .arg(&(cols.max(1) as i32))
                .launch(cfg)
        },
        "probe_finite",
    );
}

/// The (row, slot) pairs of a routed-expert call, grouped by expert (moe_sort's output): `order`,
/// the offsets `off` and the `active` list, with `blocks` its bound on the active experts.
struct Pairs<'a> {
    order: CudaView<'a, u32>,
    off: CudaView<'a, u32>,
    active: CudaView<'a, u32>,
    blocks: u32,
}

/// Experts, slots a row, model width and expert width.
#[derive(Clone, Copy)]
struct ExpertShape {
    nexp: usize,
    k: usize,
    d: usize,
    inter: usize,
}

/// Gate/up with the clamped SwiGLU into `h` (a row per pair) and down into `y`, on int8
/// activations: x's twin, gate/up, quant_x8 of h, down. The one-row kernels (one pair an
/// expert) take several outputs a warp (quant::x8_opw).
#[allow(clippy::too_many_arguments)]
fn x8_pairs(
    b: &CudaBackend,
    (up1x, down1x): (&CudaFunction, &CudaFunction),
    table: &CudaSlice<u64>,
    p: &Pairs<'_>,
    s: ExpertShape,
    x: &CudaTensor,
    (h, y): (&mut CudaSlice<f32>, &mut CudaSlice<f32>),
    limit: f32,
    tiles: bool,
) {
    let (ki, di, ii, nei) = (s.k as i32, s.d as i32, s.inter as i32, s.nexp as i32);
    let all = super::quant::x8_opw();
    let o = if x.rows == 1 { all } else { super::quant::X8Opw { gemv: 1, up: 1, down: all.downn, downn: 1, ..all } };
    // Warp kernels: 8 outputs a block (per_warp each); tile kernels: 16 a block. The tile
    // kernels stride over their output tiles, so a grid of 1 / rounds the blocks takes them all.
    let rounds = |cols: usize| if tiles { super::quant::tile_rounds(p.blocks as usize * cols.div_ceil(16)) } else { 1 };
    let grid = |cols: usize, per_warp: usize| LaunchConfig {
        grid_dim: (p.blocks, cols.div_ceil(if tiles { 16 } else { 8 * per_warp }).div_ceil(rounds(cols)) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let super::X8Twin { q: xq, d: xd } = b.x8_of(x);
    // SAFETY (both launches): argument types and buffer sizes match the kernels; h holds a row
    // of `inter` per pair, y a row of `d`.
    ck(
        unsafe {
            b.stream()
                .kernel(up1x)
                .arg(&mut *h)
                .arg(xq)
                .arg(xd)
                .arg(&p.order)
                .arg(&p.off)
                .arg(&p.active)
                .arg(table)
                .arg(&nei)
                .arg(&ki)
                .arg(&di)
                .arg(&ii)
                .arg(&limit)
                .launch(grid(s.inter, o.up))
        },
        "moe_up int8",
    );
    let (hq, hd) = b.quant_x8(h, h.len());
    ck(
        unsafe {
            b.stream()
                .kernel(down1x)
                .arg(y)
                .arg(&hq)
                .arg(&hd)
                .arg(&p.order)
                .arg(&p.off)
                .arg(&p.active)
                .arg(table)
                .arg(&nei)
                .arg(&di)
                .arg(&ii)
                .launch(grid(s.d, o.down))
        },
        "moe_down int8",
    );
}

/// Most token rows `moe_up1s` / `moe_down1s` take (their buffers' size; [`ffn1_rows`] the
/// default bound).
pub(crate) const FFN1_MAX_ROWS: usize = 8;

/// Counters `moe_up1s` keeps for its 32-value groups: n·(k + 1)·inter / 32 of them at most
/// (n ≤ [`FFN1_MAX_ROWS`] rows of k + 1 ≤ 8 pairs of up to 8,192 values).
pub(crate) const FFN1_COUNTERS: usize = FFN1_MAX_ROWS * 8 * 256;

/// Whether a quant.cu stages the two-launch experts' rows: it has `X8_STAGE` and no
/// `#define X8_STAGE 0` line (the comments that name the setting do not count).
fn stages_experts(src: &str) -> bool {
    src.contains("X8_STAGE") && !src.lines().any(|l| l.trim_start().starts_with("#define X8_STAGE 0"))
}

/// The value of a `#define NAME N` (or `# define NAME N`) line of a kernel source, the first
/// such line (comments that name it do not count).
fn define_value(src: &str, name: &str) -> Option<usize> {
    src.lines().find_map(|l| {
        let l = l.trim_start().strip_prefix('#')?.trim_start().strip_prefix("define")?;
        let mut w = l.split_whitespace();
        (w.next() == Some(name)).then(|| w.next()?.parse().ok()).flatten()
    })
}

/// Pair columns of moe_up1s's grid a token row takes for the shared expert: quant.cu's
/// `X8_UP1_SHARED` where its `up1_split` applies it (routed IQ2_XXS rows staged, `X8_STAGE`'s
/// bit 1, at up to 4 outputs a warp that it divides), else 1.
fn up1_shared_split(routed: dsv4_model::PackedFormat, opw: usize) -> usize {
    static SRC: std::sync::OnceLock<(usize, usize)> = std::sync::OnceLock::new();
    let (stage, split) = *SRC.get_or_init(|| {
        let src = super::kernel_source("quant.cu", include_str!("kernels/quant.cu"));
        (define_value(&src, "X8_STAGE").unwrap_or(0), define_value(&src, "X8_UP1_SHARED").unwrap_or(1).max(1))
    });
    if routed == dsv4_model::PackedFormat::IQ2_XXS && stage & 1 == 1 && opw <= 4 && opw.is_multiple_of(split) {
        split
    } else {
        1
    }
}

/// Start value of [`CudaBackend::set_ffn1_rows`]: `DSV4_FFN1_ROWS` (1 to [`FFN1_MAX_ROWS`]),
/// else 4 where quant.cu stages the two-launch experts' rows through shared memory
/// (`X8_STAGE`, the built-in since v52) and 1 where it does not (a kernel directory from
/// before, without `X8_STAGE`, or with a `#define X8_STAGE 0` line): see
/// [`CudaBackend::set_ffn1_rows`].
pub(crate) fn ffn1_rows_env() -> usize {
    let default =
        if stages_experts(&super::kernel_source("quant.cu", include_str!("kernels/quant.cu"))) { 4 } else { 1 };
    match std::env::var("DSV4_FFN1_ROWS") {
        Err(_) => default,
        Ok(v) => match v.trim().parse() {
            Ok(n) if (1..=FFN1_MAX_ROWS).contains(&n) => n,
            _ => {
                tracing::warn!("DSV4_FFN1_ROWS={v:?} is not 1 to {FFN1_MAX_ROWS}; using {default}");
                default
            }
        },
    }
}

/// A few token rows' routed experts, shared expert and their sum (see
/// [`CudaBackend::set_ffn1`]): `(routed, shared, routed + shared)`, bitwise what
/// [`Backend::moe`](crate::Backend::moe), the shared expert's product and the add give. `None`
/// where the separate launches must run: more than [`CudaBackend::ffn1_rows`] rows, a share of the experts,
/// more than 7 routed slots, formats without int8 kernels (or a pair quant.cu does not
/// instantiate), or the int8 path off.
pub(crate) fn ffn_few_rows(
    b: &CudaBackend,
    x: &CudaTensor,
    route: &CudaRoute,
    experts: &[Expert<CudaWeight>],
    first: usize,
    shared: &Expert<CudaWeight>,
    limit: f32,
) -> Option<(CudaTensor, CudaTensor, CudaTensor)> {
    let (d, k, e0, n) = (x.cols, route.k, &experts[0], x.rows);
    let inter = e0.w1.rows;
    let pairs = k + 1;
    let blk = crate::x8::BLOCK;
    let fmt = |w: &CudaWeight| w.q.as_ref().map(|q| q.format).filter(|&f| crate::x8::supports(f));
    let (r13, r2, s13, s2) = (fmt(&e0.w1)?, fmt(&e0.w2)?, fmt(&shared.w1)?, fmt(&shared.w2)?);
    let o = super::quant::x8_opw();
    // The separate launches this replaces are the one-row expert kernels for the shared expert
    // too (DSV4_SHARED_X8), and quant_groups needs 8·opw to divide 32 or be a multiple of it.
    let fits = (1..=b.ffn1_rows()).contains(&n)
        && b.int8()
        && b.fusion.shared_x8
        && matches!(o.up1s_for(r13), 1 | 2 | 4 | 8)
        && first == 0
        && experts.len() == route.experts
        && pairs <= Q_WARPS
        && fmt(&e0.w3) == Some(r13)
        && fmt(&shared.w3) == Some(s13)
        && (shared.w1.rows, shared.w2.cols, e0.w2.cols) == (inter, inter, inter)
        && d.is_multiple_of(blk)
        && inter.is_multiple_of(blk)
        && n * pairs * inter / blk <= FFN1_COUNTERS;
    if !fits {
        return None;
    }
    assert!(route.ids.len() >= n * k && route.weights.len() >= n * k, "route of {n} rows × {k} slots");
    let (up, down) = b.qk.ffn1((r13, r2), (s13, s2), n)?;
    let table = b.packed_expert_kernels(experts, 1, false).table;
    let stable = b.packed_expert_kernels(std::slice::from_ref(shared), 1, false).table;
    let super::X8Twin { q: xq, d: xd } = b.x8_of(x);
    let mut h = b.alloc::<f32>(n * pairs * inter);
    let mut hq = b.alloc::<i8>(n * pairs * inter);
    let mut hd = b.alloc::<f32>(n * pairs * inter / blk);
    let (nei, ki, di, ii) = (experts.len() as i32, k as i32, d as i32, inter as i32);
    // The routed slots' pair columns, then the shared expert's (`up1_shared_split`).
    let cols = k + up1_shared_split(r13, o.up1s_for(r13));
    let up_cfg = LaunchConfig {
        grid_dim: ((n * cols) as u32, inter.div_ceil(Q_WARPS * o.up1s_for(r13)) as u32, 1),
        block_dim: (32 * Q_WARPS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: argument types and buffer sizes match the kernel: x's codes hold n rows of d, h
    // and hq n·(k + 1) rows of `inter`, hd their scales, the counters (zero between launches)
    // cover n·(k + 1)·inter / 32 groups (checked above), route.ids k slots of each of the n rows,
    // the tables address every routed expert (nexp) and the shared one.
    ck(
        unsafe {
            b.stream()
                .kernel(up)
                .arg(&mut h)
                .arg(&mut hq)
                .arg(&mut hd)
                .arg(b.counters())
                .arg(xq)
                .arg(xd)
                .arg(&route.ids)
                .arg(table.as_ref())
                .arg(stable.as_ref())
                .arg(&nei)
                .arg(&ki)
                .arg(&di)
                .arg(&ii)
                .arg(&limit)
                .launch(up_cfg)
        },
        "moe_up1s",
    );
    let (mut routed, mut sh, mut out) = (b.tensor(n, d), b.tensor(n, d), b.tensor(n, d));
    let down_warps = if down1_pair_warps() { pairs } else { Q_WARPS };
    let down_cfg = LaunchConfig {
        grid_dim: (d.div_ceil(o.down1s) as u32, n as u32, 1),
        block_dim: (32 * down_warps as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: argument types and buffer sizes match the kernel: hq / hd hold the n·(k + 1) rows
    // moe_up1s wrote, route.ids / weights k slots of each of the n rows, routed / shared / out n
    // rows of d, the tables every routed expert and the shared one.
    ck(
        unsafe {
            b.stream()
                .kernel(down)
                .arg(&mut routed.data)
                .arg(&mut sh.data)
                .arg(&mut out.data)
                .arg(&hq)
                .arg(&hd)
                .arg(&route.ids)
                .arg(&route.weights)
                .arg(table.as_ref())
                .arg(stable.as_ref())
                .arg(&nei)
                .arg(&ki)
                .arg(&di)
                .arg(&ii)
                .launch(down_cfg)
        },
        "moe_down1s",
    );
    Some((routed, sh, out))
}

/// Most rows the shared expert takes on the routed-expert kernels ([`shared_expert_x8`]): a
/// verify of 1 + 1..3 drafts. Past them the dense products' tiles take its three products.
pub(crate) const SHARED_X8_ROWS: usize = 4;

/// The pair tables of n = 1..=[`SHARED_X8_ROWS`] rows through one expert, as moe_sort would
/// write them: the order 0..n (words 0..8), then for each n 16 words at 8 + 16·(n − 1) (16-byte
/// aligned, for the slot record's uint4 load): the active list [expert 0, 1 active] padded to
/// 4 words, the slot record {expert 0, first pair 0, n pairs, 1 active}, then off [0, n].
pub(crate) fn shared_pairs_words() -> Vec<u32> {
    let mut w: Vec<u32> = (0..8).collect();
    for n in 1..=SHARED_X8_ROWS as u32 {
        w.extend([0, 1, 0, 0, 0, 0, n, 1, 0, n, 0, 0, 0, 0, 0, 0]);
    }
    w
}

/// The shared expert of 1 to [`SHARED_X8_ROWS`] rows on int8 activations, as a routed expert
/// that every row chose once: gate/up and SwiGLU in one launch, down in another (the one-row
/// kernels at one row, the row-group kernels past it: each row's sums are the three products'
/// of that row alone, bitwise). At 2–4 rows (a DSpark verify) the products ran as gate, up,
/// swiglu_act, quant_x8 and down: two launches fewer, and the gate and up rows read together.
/// `None` where its weights are not all in int8-product formats (or the backend's int8 path is
/// off); the caller then takes the products.
pub(crate) fn shared_expert_x8(
    b: &CudaBackend,
    x: &CudaTensor,
    e: &Expert<CudaWeight>,
    limit: f32,
) -> Option<CudaTensor> {
    let (n, d, inter) = (x.rows, x.cols, e.w1.rows);
    let blk = crate::x8::BLOCK;
    let fmt = |w: &CudaWeight| w.q.as_ref().map(|q| q.format);
    let packed = fmt(&e.w1).is_some() && fmt(&e.w2).is_some() && fmt(&e.w1) == fmt(&e.w3);
    if !(1..=b.fusion.shared_rows).contains(&n) || !packed || !d.is_multiple_of(blk) || !inter.is_multiple_of(blk) {
        return None;
    }
    let ek = b.packed_expert_kernels(std::slice::from_ref(e), n, false);
    let kernels = ek.x8?;
    let (t, base) = (&b.shared_pairs, 8 + 16 * (n - 1));
    let pairs =
        Pairs { order: t.slice(0..n), off: t.slice(base + 8..base + 10), active: t.slice(base..base + 8), blocks: 1 };
    let mut h = b.alloc::<f32>(n * inter);
    let mut out = b.tensor(n, d);
    let shape = ExpertShape { nexp: 1, k: 1, d, inter };
    x8_pairs(b, kernels, &ek.table, &pairs, shape, x, (&mut h, &mut out.data), limit, ek.x8_tiles);
    Some(out)
}

/// Words of moe_sort's `active` buffer for `ne` experts: the active list (`ne + 1`, padded to 16
/// bytes), then a 4-word slot record an expert (common.cuh `moe_slots`).
fn moe_active_words(ne: usize) -> usize {
    ((ne + 4) & !3) + 4 * ne
}

/// Routed experts with bf16 or packed weights (see the module docs and [`super::quant`]).
/// `experts[i]` is global expert `first + i`; with `share` (a rank's share of the experts) the
/// slots routed elsewhere add nothing.
pub(crate) fn moe(
    b: &CudaBackend,
    x: &CudaTensor,
    route: &CudaRoute,
    experts: &[Expert<CudaWeight>],
    first: usize,
    share: bool,
    limit: f32,
) -> CudaTensor {
    let (n, d, k) = (x.rows, x.cols, route.k);
    let inter = experts[0].w1.rows;
    let ne = experts.len();
    assert!(ne <= 1024, "{ne} experts > 1024");
    let nk = n * k;
    let mut out = b.tensor(n, d);
    if n == 0 {
        return out;
    }
    let packed = [&experts[0].w1, &experts[0].w3, &experts[0].w2].iter().any(|w| w.q.is_some());
    let mut order = b.alloc::<u32>(nk);
    let mut off = b.alloc::<u32>(ne + 1);
    let mut active = b.alloc::<u32>(moe_active_words(ne));
    let one = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
    // SAFETY (every launch below): argument types and buffer sizes match the kernels.
    ck(
        unsafe {
            b.stream()
                .kernel(&b.k.moe_sort)
                .arg(&mut order)
                .arg(&mut off)
                .arg(&mut active)
                .arg(&route.ids)
                .arg(&(nk as i32))
                .arg(&(ne as i32))
                .arg(&(first as u32))
                .launch(one)
        },
        "moe_sort",
    );
    let (ki, di, ii, nei) = (k as i32, d as i32, inter as i32, ne as i32);
    // The grouped kernels (quant.cu, bf16 being one of its formats) step 8 values at a time;
    // widths that are not multiples of 8 (no V4 shape) take the cuBLAS path below.
    // int8 tile kernels (packed experts of int8 formats) serve as many rows as the dense
    // products' int8 path does (`DSV4_X8_MAX_ROWS`), so a row's experts stay batch invariant
    // wherever its products do.
    // In exact mode any number of rows stays on the int8 kernels, and the tiles take the experts
    // once they hold enough pairs each (`expert_tiles`): the same sums as the dp4a row groups.
    let full = b.expert_tiles(nk, ne);
    let tiles = packed
        && b.int8()
        && (b.x8_tiles() == super::quant::X8Tiles::All || (full && b.x8_tiles() == super::quant::X8Tiles::Dense))
        && [&experts[0].w1, &experts[0].w2].iter().all(|w| w.q.as_ref().is_some_and(|q| crate::x8::supports(q.format)))
        && (n <= b.x8_rows() || b.exact());
    if (n <= grouped_max_rows() || b.exact() || tiles) && d.is_multiple_of(8) && inter.is_multiple_of(8) {
        let ek = b.packed_expert_kernels(experts, n, full);
        let table = &ek.table;
        let mut h = b.alloc::<f32>(nk * inter);
        let mut y = b.alloc::<f32>(nk * d);
        if share {
            // The combine reads every slot's row: those of other ranks' experts must be zero.
            ck(b.stream().memset_zeros(&mut y), "zero expert outputs");
        }
        let blocks = nk.min(ne) as u32;
        let up = LaunchConfig {
            grid_dim: (blocks, inter.div_ceil(8) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let down =
            LaunchConfig { grid_dim: (blocks, d.div_ceil(8) as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let blk = crate::x8::BLOCK;
        if let Some(kernels) = ek.x8.filter(|_| d.is_multiple_of(blk) && inter.is_multiple_of(blk)) {
            let pairs = Pairs { order: order.as_view(), off: off.as_view(), active: active.as_view(), blocks };
            let shape = ExpertShape { nexp: ne, k, d, inter };
            x8_pairs(b, kernels, table, &pairs, shape, x, (&mut h, &mut y), limit, ek.x8_tiles);
        } else {
            ck(
                unsafe {
                    b.stream()
                        .kernel(ek.up)
                        .arg(&mut h)
                        .arg(&x.data)
                        .arg(&order)
                        .arg(&off)
                        .arg(&active)
                        .arg(table.as_ref())
                        .arg(&nei)
                        .arg(&ki)
                        .arg(&di)
                        .arg(&ii)
                        .arg(&limit)
                        .launch(up)
                },
                "moe_up grouped",
            );
            ck(
                unsafe {
                    b.stream()
                        .kernel(ek.down)
                        .arg(&mut y)
                        .arg(&h)
                        .arg(&order)
                        .arg(&off)
                        .arg(&active)
                        .arg(table.as_ref())
                        .arg(&nei)
                        .arg(&di)
                        .arg(&ii)
                        .launch(down)
                },
                "moe_down grouped",
            );
        }
        super::moe::combine(b, &mut out, &y, &route.weights, k);
        return out;
    }
    // Many rows: the tensor-core tiles, every expert in one launch a projection.
    if super::gemm::experts_fit(d, inter) {
        let ek = b.packed_expert_kernels(experts, usize::MAX, false);
        let mut y = b.alloc::<f32>(nk * d);
        if share {
            // The combine reads every slot's row: those of other ranks' experts must be zero.
            ck(b.stream().memset_zeros(&mut y), "zero expert outputs");
        }
        let pairs = super::gemm::SortedPairs { order: order.as_view(), off: off.as_view(), nexp: ne, k, d, inter };
        b.pgemm_experts(&ek, x, &pairs, &mut y, limit);
        super::moe::combine(b, &mut out, &y, &route.weights, k);
        return out;
    }
    // Otherwise: per-expert cuBLAS over the gathered rows (offsets read back once).
    let offs = ck(b.stream().clone_dtoh(&off), "read expert offsets");
    ck(b.stream().synchronize(), "synchronize");
    // Slots held here (all of them unless this is a share of the experts).
    let held = offs[ne] as usize;
    if held == 0 {
        ck(b.stream().memset_zeros(&mut out.data), "zero routed output");
        return out;
    }
    let mut xs = b.alloc::<u16>(nk * d);
    let mut inv = b.alloc::<u32>(nk);
    if share {
        let (p, _w) = inv.device_ptr_mut(b.stream());
        // SAFETY: `inv` holds `nk` u32 values; the set is ordered on the backend's stream.
        let r = unsafe { cudarc::driver::sys::cuMemsetD32Async(p, u32::MAX, nk, b.stream().cu_stream()) };
        assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS, "cuMemsetD32Async");
    }
    ck(
        unsafe {
            b.stream()
                .kernel(&b.k.moe_gather_bf16)
                .arg(&mut xs)
                .arg(&mut inv)
                .arg(&x.data)
                .arg(&order)
                .arg(&(held as i32))
                .arg(&ki)
                .arg(&di)
                .launch(cfg1d(held * d, 256))
        },
        "moe_gather_bf16",
    );
    let g = b.alloc::<f32>(nk * inter);
    let u = b.alloc::<f32>(nk * inter);
    let mut hb = b.alloc::<u16>(nk * inter);
    let y = b.alloc::<f32>(nk * d);
    let (xp, gp, up, hp, yp) = (b.dev_ptr(&xs), b.dev_ptr(&g), b.dev_ptr(&u), b.dev_ptr(&hb), b.dev_ptr(&y));
    // Packed experts are dequantised, one matrix at a time, into bf16 scratch that the stream
    // reuses in order (each product has consumed it before the next dequantisation).
    let scratch: Vec<CudaSlice<u16>> =
        if packed { (0..3).map(|_| b.alloc::<u16>(inter * d)).collect() } else { vec![] };
    let wptr = |w: &CudaWeight, i: usize| match (&w.bf, &w.q) {
        (Some(bf), _) => b.dev_ptr(bf),
        (None, Some(q)) => {
            let dst = b.dev_ptr(&scratch[i]);
            b.dequant_bf16_into(dst, q, w.rows, w.cols);
            dst
        }
        (None, None) => panic!("bf16 or packed expert expected"),
    };
    for (e, ex) in experts.iter().enumerate() {
        let (o, c) = (offs[e] as usize, (offs[e + 1] - offs[e]) as usize);
        if c == 0 {
            continue;
        }
        b.gemm_bf16_raw(gp + (o * inter * 4) as u64, xp + (o * d * 2) as u64, wptr(&ex.w1, 0), c, d, inter);
        b.gemm_bf16_raw(up + (o * inter * 4) as u64, xp + (o * d * 2) as u64, wptr(&ex.w3, 1), c, d, inter);
    }
    let len = nk * inter;
    ck(
        unsafe {
            b.stream()
                .kernel(&b.k.swiglu_bf16)
                .arg(&mut hb)
                .arg(&g)
                .arg(&u)
                .arg(&(len as i64))
                .arg(&limit)
                .launch(cfg1d(len, 256))
        },
        "swiglu_bf16",
    );
    for (e, ex) in experts.iter().enumerate() {
        let (o, c) = (offs[e] as usize, (offs[e + 1] - offs[e]) as usize);
        if c == 0 {
            continue;
        }
        b.gemm_bf16_raw(yp + (o * d * 4) as u64, hp + (o * inter * 2) as u64, wptr(&ex.w2, 2), c, inter, d);
    }
    ck(
        unsafe {
            b.stream()
                .kernel(&b.k.moe_combine_sorted)
                .arg(&mut out.data)
                .arg(&y)
                .arg(&inv)
                .arg(&route.weights)
                .arg(&(n as i32))
                .arg(&ki)
                .arg(&di)
                .launch(cfg1d(n * d, 256))
        },
        "moe_combine_sorted",
    );
    out
}

#[cfg(test)]
mod tests {
    use super::stages_experts;

    #[test]
    fn the_built_in_quant_cu_stages_the_experts() {
        let built_in = include_str!("kernels/quant.cu");
        assert!(stages_experts(built_in), "the built-in quant.cu should stage (DSV4_FFN1_ROWS then defaults to 4)");
        let off = built_in.replace("#define X8_STAGE 3", "#define X8_STAGE 0");
        assert!(!stages_experts(&off));
        assert!(!stages_experts("// a quant.cu from before v52\n#define X8_PIPE 0\n"));
    }

    /// The launcher reads quant.cu's `#define` lines, not the comments that name them: the
    /// built-in splits the shared pair over 1 block (`X8_UP1_SHARED`) and stages both kernels.
    #[test]
    fn the_launcher_reads_quant_cu_defines() {
        use super::define_value;
        let built_in = include_str!("kernels/quant.cu");
        assert_eq!(define_value(built_in, "X8_UP1_SHARED"), Some(1));
        assert_eq!(define_value(built_in, "X8_STAGE"), Some(3));
        assert_eq!(define_value(built_in, "X8_UP1_BLOCKS"), Some(3));
        assert_eq!(
            define_value("// X8_UP1_SHARED 2: see\n  #define X8_UP1_SHARED 2 // two\n", "X8_UP1_SHARED"),
            Some(2)
        );
        assert_eq!(define_value("#define X8_UP1_SHAREDX 2\n", "X8_UP1_SHARED"), None);
        assert_eq!(define_value("# define X8_UP1_SHARED 4\n", "X8_UP1_SHARED"), Some(4));
        assert_eq!(define_value("#ifndef X8_UP1_SHARED\n#undef X8_UP1_SHARED\n", "X8_UP1_SHARED"), None);
    }
}
