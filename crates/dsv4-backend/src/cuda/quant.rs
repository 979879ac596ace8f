//! Launchers of `kernels/quant.cu`: weights kept in their checkpoint format on the device.
//!
//! GGUF Q8_0 / Q4_K / Q2_K / IQ2_XXS blocks (split into a code plane and a head plane, see
//! [`dsv4_model::packed::Planes`]) and the official FP8 / FP4 weights (FP4's UE8M0 scales as
//! one byte each) are dequantised inside the kernels: the
//! small-batch product and the grouped routed experts read each block once per step, which is
//! what decode at batch 1 is bound by. On int8 activations (Q8_0, Q2_K, IQ2_XXS), products of
//! several rows run on int8 tensor-core tiles (`mma`) or dp4a row groups, bitwise the one-row
//! sums either way ([`X8Tiles`]). Larger products dequantise the weight to a bf16 scratch and
//! use cuBLAS, like bf16 weights.

use super::bf16::FFN1_COUNTERS;
use super::launch::{Kernel, KernelStruct};
use super::{cfg1d, ck, CudaBackend, CudaTensor, CudaWeight, X8Twin};
use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig};
use dsv4_model::packed::{Packed, PackedFormat};
use dsv4_model::LoadError;
use std::collections::HashMap;
use std::sync::Arc;

/// Largest row count of a packed product that runs the fused-dequant kernels (above it the
/// weight is dequantised to bf16 for cuBLAS). Up to it a row's result does not depend on the
/// row count (the dp4a row groups read each weight byte once per group of up to 8 rows; the
/// tensor-core tiles once per 16 rows, with the same sums); above it a row's result does (bf16
/// activations instead of int8). The tiles would serve more rows, but past 16 their rate halves
/// with each doubling (PERF.md v14), and prefill on them measured slower than the bf16 path.
pub const QGEMV_ROWS: usize = 16;

/// The row count above which packed products take the bf16 path: `DSV4_X8_MAX_ROWS`, default
/// [`QGEMV_ROWS`] (A/B of batch invariance at serving batches against the cuBLAS path).
pub(crate) fn qgemv_rows_env() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| std::env::var("DSV4_X8_MAX_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(QGEMV_ROWS))
}

/// Warps per block of `quant.cu`'s product and expert kernels (its `Q_WARPS`).
pub(crate) const Q_WARPS: usize = 8;

/// Which products of several rows on int8 activations run on the tensor-core tiles (`gemvt`,
/// `moe_upt`, `moe_downt`: bitwise the one-row sums, PERF.md v14) rather than the dp4a row
/// groups (`gemvx`, `moe_upx`, `moe_downx`: the same results). Start value `DSV4_X8_TILES` =
/// `dense` (the default: the projections of [`TILE_MIN_ROWS`] rows or more), `all` (the routed
/// experts too) or `off`; [`CudaBackend::set_x8_tiles`] changes it. Measured on the 43-layer q2
/// step at batch 16: dense 54.5 ms, off 62.2, all 76.6 (an expert holds one or two of the
/// step's rows, where the tiles read 16 outputs' codes in narrow loads: PERF.md v14).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum X8Tiles {
    Off = 0,
    Dense = 1,
    All = 2,
}

impl X8Tiles {
    pub(crate) fn from_env() -> Self {
        match std::env::var("DSV4_X8_TILES").as_deref() {
            Err(_) | Ok("dense") => X8Tiles::Dense,
            Ok("1" | "all") => X8Tiles::All,
            Ok("0" | "off") => X8Tiles::Off,
            Ok(v) => {
                tracing::warn!("DSV4_X8_TILES={v:?} is not dense, all or off; using dense");
                X8Tiles::Dense
            }
        }
    }

    pub(crate) fn from_u8(v: u8) -> Self {
        match v {
            0 => X8Tiles::Off,
            1 => X8Tiles::Dense,
            _ => X8Tiles::All,
        }
    }
}

/// Fewest rows a dense product takes the tiles at: below, the dp4a row groups are faster (one
/// weight pass for up to 8 rows; at 2 and 4 rows 1.4–2× the tiles' rate in the kernel table).
pub const TILE_MIN_ROWS: usize = 5;

/// The int8 product kernel of `n` rows off the tiles: the one-row kernel, the several-row kernel
/// built for at most 2 or 4 rows where `caps` ([`CudaBackend::set_row_caps`]), or the general
/// one. Any of them gives every row the same value.
fn gemvx_name(n: usize, caps: bool) -> &'static str {
    match n {
        1 => "gemv1x",
        2 if caps => "gemvx2",
        3 | 4 if caps => "gemvx4",
        _ => "gemvx",
    }
}

/// gemvo's outputs a warp and rows a block (quant.cu's GEMVO_OUTS, GEMVO_ROWS), and the rows
/// from which the f32-activation products take it over gemv (same bits: a choice of speed only).
const GEMVO_OUTS: usize = 4;
const GEMVO_ROWS: usize = 32;
const GEMVO_MIN_ROWS: usize = 17;

/// Outputs a tile block covers (the mma's 16) and rows an n-tile holds (its 8).
const TILE_OUTPUTS: usize = 16;
const TILE_ROWS: usize = 8;

/// The tile kernels' shapes: (n-tiles of 8 rows, warps) a block.
const TILE_SHAPES: [(usize, usize); 4] = [(1, 8), (2, 8), (1, 16), (2, 16)];

/// Dynamic shared memory of `gemvtc{nt}{w}_q8_0` (quant.cu `gemvt_cp`): each warp's ring of
/// XTC_ST = 2 stages of XTC_U = 4 chunk slots, a slot `xtc_slot(nt)` bytes (the tile's 16 weight
/// rows' codes and scale words, the 8·nt activation rows' codes and scales).
fn xtc_smem(nt: usize, w: usize) -> usize {
    let slot = 512 + 64 + 32 * 8 * nt + 4 * 8 * nt;
    w * 2 * 4 * slot
}

/// The tile product kernel for `n` rows and `m` outputs: n-tiles a block (1 or 2) and warps a
/// block (16 where the grid would not fill the GPU twice over, else 8); all give the same sums.
fn tile_gemv(n: usize, m: usize) -> (usize, usize) {
    let nt = if n <= TILE_ROWS { 1 } else { 2 };
    let blocks = n.div_ceil(TILE_ROWS * nt) * m.div_ceil(TILE_OUTPUTS);
    (nt, if blocks < 264 { 16 } else { 8 })
}

/// The grouped expert kernels of one expert set.
pub(crate) struct ExpertKernels<'a> {
    pub up: &'a CudaFunction,
    pub down: &'a CudaFunction,
    pub table: Arc<CudaSlice<u64>>,
    /// The int8-activation kernels (up, down; the one-row ones for `single`, else the tile
    /// ones where [`X8Tiles::All`]), where the backend's int8 path is on and both formats have them.
    pub x8: Option<(&'a CudaFunction, &'a CudaFunction)>,
    /// `x8` are the tile kernels (`moe_upt` / `moe_downt`: blocks of 16 outputs).
    pub x8_tiles: bool,
    /// The tensor-core tiles for many rows (gemm.cu: `pgemm_up64`, `pgemm_down64`, and the
    /// 128-row tiles).
    pub pg_up: &'a CudaFunction,
    pub pg_down: &'a CudaFunction,
    pub pg_up128: &'a CudaFunction,
    pub pg_down128: &'a CudaFunction,
    /// The 128-row tiles on wgmma (`pgemm_up128w`, `pgemm_down128w`; [`CudaBackend::pgemm_wgmma`]).
    pub pg_up128w: &'a CudaFunction,
    pub pg_down128w: &'a CudaFunction,
}

/// A weight in a packed format on the device.
pub struct QuantDev {
    pub format: PackedFormat,
    /// GGUF: the blocks' code plane; FP8 / FP4: the values as stored.
    pub blocks: CudaSlice<u8>,
    /// GGUF: the blocks' head plane (d, dmin, sub-block scales); FP8: f32 block scales (as
    /// bytes); FP4: one UE8M0 byte per 32 inputs.
    pub scales: CudaSlice<u8>,
}

impl QuantDev {
    pub fn bytes(&self) -> usize {
        self.blocks.len() + self.scales.len()
    }
}

/// (routed, shared) format pairs of quant.cu's `X8_FFN1_KERNELS`: the shared expert in Q8_0 (as
/// ds4's q2 and q4 files store it) or in the routed experts' own format.
const FFN1_PAIRS: [(PackedFormat, PackedFormat); 5] = [
    (PackedFormat::Q8_0, PackedFormat::Q8_0),
    (PackedFormat::Q2_K, PackedFormat::Q8_0),
    (PackedFormat::IQ2_XXS, PackedFormat::Q8_0),
    (PackedFormat::Q2_K, PackedFormat::Q2_K),
    (PackedFormat::IQ2_XXS, PackedFormat::IQ2_XXS),
];

/// Kernel-name suffix of a format.
fn suffix(f: PackedFormat) -> &'static str {
    match f {
        PackedFormat::Q8_0 => "q8_0",
        PackedFormat::Q4_K => "q4_k",
        PackedFormat::Q2_K => "q2_k",
        PackedFormat::IQ2_XXS => "iq2_xxs",
        PackedFormat::Fp8 => "fp8",
        PackedFormat::Fp4 => "fp4",
    }
}

/// Outputs one warp computes in the one-row int8 kernels: the dense products (`gemv`), the
/// separate expert kernels (`up`, `down`; `downn` the several-row down kernel's) and the
/// two-launch experts a decode step runs (`up1s`, `down1s`). More outputs a warp put more loads
/// in flight and share one activation chunk, but take registers. The two-launch pair defaults to
/// 4 and 4 (4 gate/up outputs for IQ2_XXS rows only, [`X8Opw::up1s_for`]: its Q8_0 and Q2_K
/// forms spill at 4): its blocks then run ~1 and ~4 waves instead of ~4.5 and ~8 (moe_down1s
/// held to 2 blocks an SM by quant.cu's `DOWN1_BOUNDS`), and an IQ2_XXS moe_up1s block writes
/// whole 32-value groups, so it quantises them with no ticket. H100, 32 q2 layers: one-row
/// experts 51.4 → 47.3 µs a call from DRAM, the step 6.17 → 6.07 ms, batches 16 / 64 a tie
/// (PERF.md v49). The separate kernels stay at 1 (at 4 their Q8_0 and Q2_K gate/up spill ~1 KB a
/// thread), and so do the dense products (nothing gained past 1, v48). The sums are the same
/// either way. `DSV4_X8_OPW=GEMV,UP,DOWN[,DOWNN[,UP1S,DOWN1S]]` (each 1 to 8; DOWNN 1 or 2)
/// overrides them; without the last two, UP and DOWN set both expert forms (`1,1,1` is the
/// default before v49). A quant.cu from `DSV4_CUDA_KERNELS` older than v49 runs the pair at UP
/// and DOWN, so its grids are sized that way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct X8Opw {
    pub gemv: usize,
    pub up: usize,
    pub down: usize,
    pub downn: usize,
    pub up1s: usize,
    pub down1s: usize,
}

impl X8Opw {
    /// moe_up1s's outputs a warp for routed gate/up rows of format `f`: `up1s` for IQ2_XXS,
    /// else `up` (quant.cu's moe_up1s: its Q8_0 and Q2_K forms spill at 4).
    pub(crate) fn up1s_for(&self, f: PackedFormat) -> usize {
        if f == PackedFormat::IQ2_XXS {
            self.up1s
        } else {
            self.up
        }
    }
}

pub(crate) fn x8_opw() -> X8Opw {
    static OPW: std::sync::OnceLock<X8Opw> = std::sync::OnceLock::new();
    *OPW.get_or_init(|| {
        let o = x8_opw_of(std::env::var("DSV4_X8_OPW").ok().as_deref());
        if super::kernel_source("quant.cu", include_str!("kernels/quant.cu")).contains("X8_OPW_DOWN1S") {
            o
        } else {
            X8Opw { up1s: o.up, down1s: o.down, ..o }
        }
    })
}

/// [`x8_opw`] for a value of `DSV4_X8_OPW` (None: unset).
fn x8_opw_of(v: Option<&str>) -> X8Opw {
    let default = X8Opw { gemv: 1, up: 1, down: 1, downn: 1, up1s: 4, down1s: 4 };
    let Some(v) = v else { return default };
    let n: Vec<usize> = v.split(',').filter_map(|t| t.trim().parse().ok()).collect();
    let ok = n.len() == v.split(',').count() && n.iter().all(|p| (1..=8).contains(p));
    match n[..] {
        [gemv, up, down] if ok => X8Opw { gemv, up, down, downn: 1, up1s: up, down1s: down },
        [gemv, up, down, downn] if ok && downn <= 2 => X8Opw { gemv, up, down, downn, up1s: up, down1s: down },
        [gemv, up, down, downn, up1s, down1s] if ok && downn <= 2 => X8Opw { gemv, up, down, downn, up1s, down1s },
        _ => {
            tracing::warn!(
                "DSV4_X8_OPW={v:?} is not GEMV,UP,DOWN[,DOWNN[,UP1S,DOWN1S]] (each 1 to 8, DOWNN 1 or 2); using {default:?}"
            );
            default
        }
    }
}

/// Output-tile rounds a block of the int8 tile kernels (`gemvt*`, `moe_upt`, `moe_downt`: a
/// block's tiles strided over a grid of 1 / rounds the blocks, for grids of at least 264 blocks
/// a round): `DSV4_TILE_ROUNDS` (1 to 16; default 1). A block's setup (the table fill, the
/// expert's pointers and pairs) is paid once for several tiles, and each tile asks L2 for the
/// next one's weights while it computes (quant.cu `tile_hint`); the same sums.
pub(crate) fn tile_rounds(blocks: usize) -> usize {
    static R: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let r = *R.get_or_init(|| {
        std::env::var("DSV4_TILE_ROUNDS")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .filter(|r| (1..=16).contains(r))
            .unwrap_or(1)
    });
    r.min(blocks / 264).max(1)
}

/// Chunks a lane loads a batch in the software-pipelined one-row kernels (quant.cu
/// `xrows_pipe`: the next batch's weights load while the current one is decoded), or 0 for the
/// load-then-decode form: `(experts, dense products)`, for IQ2_XXS rows; Q8_0 and Q2_K rows
/// then load one chunk a batch (where the load-then-decode form loads 2–4). Nonzero, it applies
/// to every one-row expert kernel (the shared expert's too) whatever `DSV4_X8_OPW`, though it
/// can only overlap work across outputs with several outputs a warp (its UP and DOWN); within an
/// output it overlaps the batches of a row longer than one batch. The sums are the same either
/// way. `DSV4_X8_PIPE=E[,G]` (each 0, 1, 2 or 4; G defaults to 0) sets it; off by default: no
/// faster at 4 layers on an H100 (PERF.md v26: moe_up1s −3 %, moe_down1s +25 % at 8 outputs a
/// warp).
pub(crate) fn x8_pipe() -> (usize, usize) {
    static PIPE: std::sync::OnceLock<(usize, usize)> = std::sync::OnceLock::new();
    *PIPE.get_or_init(|| {
        let Ok(v) = std::env::var("DSV4_X8_PIPE") else { return (0, 0) };
        let n: Vec<Option<usize>> = v.split(',').map(|t| t.trim().parse().ok()).collect();
        let ok = |p: &Option<usize>| matches!(p, Some(0 | 1 | 2 | 4));
        match n[..] {
            [Some(e)] if ok(&n[0]) => (e, 0),
            [Some(e), Some(g)] if n.iter().all(ok) => (e, g),
            _ => {
                tracing::warn!("DSV4_X8_PIPE={v:?} is not E[,G] (each 0, 1, 2 or 4); using 0,0");
                (0, 0)
            }
        }
    })
}

/// `quant.cu` with the IQ2_XXS tables of the CPU decoder and the outputs a warp prepended, and
/// `gemm.cu` (the tensor-core tiles, which decode with quant.cu's functions) appended.
pub fn source() -> String {
    let body = super::kernel_source("quant.cu", include_str!("kernels/quant.cu"));
    let gemm = super::kernel_source("gemm.cu", include_str!("kernels/gemm.cu"));
    let o = x8_opw();
    format!(
        "#define X8_OPW_GEMV {}\n#define X8_OPW_UP {}\n#define X8_OPW_DOWN {}\n#define X8_OPWN_DOWN {}\n#define X8_OPW_UP1S {}\n#define X8_OPW_DOWN1S {}\n#define X8_PIPE {}\n#define X8_PIPE_GEMV {}\n{}{body}\n{gemm}",
        o.gemv,
        o.up,
        o.down,
        o.downn,
        o.up1s,
        o.down1s,
        x8_pipe().0,
        x8_pipe().1,
        crate::x8::iq2_tables_source("__device__ const")
    )
}

/// The `quant.cu` kernels by name.
pub(crate) struct QuantKernels(HashMap<String, CudaFunction>);

impl QuantKernels {
    pub(crate) fn load(ctx: &Arc<cudarc::driver::CudaContext>) -> Result<Self, super::CudaInitError> {
        let module = super::load_kernel_module(ctx, "quant.cu", &source())?;
        let mut names = vec![
            "gather_bf16".to_string(),
            "rand_bytes".into(),
            "patch_blocks".into(),
            "iq2_even_signs_k".into(),
            "fill_u8".into(),
            "quant_x8".into(),
            "moe_tiles".into(),
            "pg_sum_splits".into(),
        ];
        for f in PackedFormat::ALL.into_iter().map(suffix).chain(["bf16w"]) {
            for k in [
                "gemv",
                "gemvo",
                "moe_up",
                "moe_down",
                "deq_bf16",
                "gemv1",
                "moe_up1",
                "moe_down1",
                "pgemm",
                "pgemm64",
                "pgemm_up64",
                "pgemm_down64",
                "pgemm_up128",
                "pgemm_down128",
                "pgemm_up128w",
                "pgemm_down128w",
            ] {
                names.push(format!("{k}_{f}"));
            }
        }
        for f in PackedFormat::ALL.into_iter().filter(|&f| crate::x8::supports(f)).map(suffix) {
            for k in [
                "gemv1x",
                "gemv1xg",
                "gemv1xq",
                "gemv1x4",
                "gemv1xg4",
                "moe_up1x",
                "moe_down1x",
                "gemvx",
                "gemvx2",
                "gemvx4",
                "gemvx2p",
                "gemvx4p",
                "gemvx2pq",
                "gemvx4pq",
                "gemvxg4p",
                "moe_upx",
                "moe_downx",
                "moe_downx2",
                "moe_downx4",
                "moe_upt",
                "moe_downt",
            ] {
                names.push(format!("{k}_{f}"));
            }
            for (nt, w) in TILE_SHAPES {
                names.push(format!("gemvt{nt}{w}_{f}"));
            }
        }
        for (nt, w) in TILE_SHAPES {
            names.push(format!("gemvtc{nt}{w}_q8_0"));
        }
        for (r, s) in FFN1_PAIRS {
            for k in ["moe_up1s", "moe_up1sn", "moe_down1s", "moe_down1sn"] {
                names.push(format!("{k}_{}_{}", suffix(r), suffix(s)));
            }
        }
        let mut m = HashMap::new();
        for n in names {
            let f = super::load_function(&module, &n)?;
            // The tensor-core tiles' stages (prefill's pgemm, the dense tiles' cp.async rings)
            // take more than the default 48 KB.
            let ring = TILE_SHAPES.into_iter().find(|&(nt, w)| n == format!("gemvtc{nt}{w}_q8_0"));
            let smem = if n.starts_with("pgemm") {
                Some(super::gemm::PG_SMEM_MAX)
            } else {
                ring.map(|(nt, w)| xtc_smem(nt, w))
            };
            if let Some(bytes) = smem {
                f.set_attribute(
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )?;
            }
            m.insert(n, f);
        }
        Ok(QuantKernels(m))
    }

    pub(crate) fn get(&self, name: &str) -> &CudaFunction {
        &self.0[name]
    }

    /// A few rows' expert kernels (`moe_up1s` and `moe_down1s`, or for several rows
    /// `moe_up1sn` and `moe_down1sn`) for routed experts in `r13` (w1/w3) and `r2` (w2) with a shared expert in
    /// `s13` / `s2`, where quant.cu instantiates them (`X8_FFN1_KERNELS`).
    pub(crate) fn ffn1(
        &self,
        (r13, r2): (PackedFormat, PackedFormat),
        (s13, s2): (PackedFormat, PackedFormat),
        rows: usize,
    ) -> Option<(&CudaFunction, &CudaFunction)> {
        let name = |k: &str, r, s| format!("{k}_{}_{}", suffix(r), suffix(s));
        let (up, down) = if rows > 1 { ("moe_up1sn", "moe_down1sn") } else { ("moe_up1s", "moe_down1s") };
        Some((self.0.get(&name(up, r13, s13))?, self.0.get(&name(down, r2, s2))?))
    }

    pub(crate) fn of(&self, kind: &str, f: PackedFormat) -> &CudaFunction {
        self.get(&format!("{kind}_{}", suffix(f)))
    }
}

/// `XG_MAX` of quant.cu: one-row int8 products one `gemv1xg` launch takes at most.
pub(crate) const XG_MAX: usize = 4;

/// `X8Group` of quant.cu: the products of one `gemv1xg` launch and the first block of each,
/// passed by value.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct X8Group {
    w: [u64; XG_MAX],
    s: [u64; XG_MAX],
    out: [u64; XG_MAX],
    m: [i32; XG_MAX],
    b0: [i32; XG_MAX + 1],
    count: i32,
}

// SAFETY: #[repr(C)] integers in quant.cu's field order (8-byte pointers first, then 4-byte
// ints: 3·4·8 + 4·(4 + 5 + 1) = 136 bytes, no padding), as the kernel declares it.
unsafe impl KernelStruct for X8Group {}

/// UE8M0 bytes of FP4 scales, if every scale is a power of two in range.
fn e8m0_bytes(scales: &[f32]) -> Option<Vec<u8>> {
    scales
        .iter()
        .map(|&s| {
            let b = s.to_bits();
            (s > 0.0 && b & 0x007f_ffff == 0 && b >> 23 < 255).then_some((b >> 23) as u8)
        })
        .collect()
}

impl CudaBackend {
    /// Uploads a packed tensor as it is; `None` when it must be dequantised instead (FP4 scales
    /// that are not UE8M0 values).
    pub(crate) fn upload_packed(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        p: &Packed,
    ) -> Result<Option<CudaWeight>, LoadError> {
        let err =
            |e: cudarc::driver::DriverError| LoadError::Value { name: name.into(), msg: format!("CUDA upload: {e:?}") };
        let want = rows * p.format.row_bytes(cols);
        if p.blocks.len() != want || p.scales.len() != p.format.n_scales(rows, cols) {
            return Err(LoadError::Value {
                name: name.into(),
                msg: format!(
                    "{} blocks: {} bytes and {} scales, expected {want} and {}",
                    p.format.name(),
                    p.blocks.len(),
                    p.scales.len(),
                    p.format.n_scales(rows, cols)
                ),
            });
        }
        let (codes, scales): (Option<Vec<u8>>, Vec<u8>) = match p.format {
            PackedFormat::Fp8 => (None, p.scales.iter().flat_map(|s| s.to_le_bytes()).collect()),
            PackedFormat::Fp4 => match e8m0_bytes(&p.scales) {
                Some(b) => (None, b),
                None => {
                    tracing::warn!("{name}: FP4 scales are not UE8M0 values; dequantising to bf16");
                    return Ok(None);
                }
            },
            f => {
                let (c, h) = f.planes().expect("a GGUF format").split(&p.blocks);
                (Some(c), h)
            }
        };
        let blocks = self.stream().clone_htod(codes.as_deref().unwrap_or(&p.blocks)).map_err(err)?;
        let scales = self.stream().clone_htod(&scales).map_err(err)?;
        let q = QuantDev { format: p.format, blocks, scales };
        self.note_x8_format(p.format);
        Ok(Some(CudaWeight { rows, cols, data: self.alloc(1), bf: None, q: Some(q) }))
    }

    /// A `[rows, cols]` weight of random valid blocks drawn on the device (synthetic
    /// checkpoints), dequantising to values of about `std`.
    pub fn upload_random_packed(
        &self,
        format: PackedFormat,
        rows: usize,
        cols: usize,
        std: f32,
        seed: u64,
    ) -> CudaWeight {
        assert!(format.fits(cols) && cols.is_multiple_of(8), "{} cannot hold rows of {cols}", format.name());
        let nblocks = rows * cols / format.block();
        let planes = format.planes();
        let n = planes.map_or(rows * format.row_bytes(cols), |p| nblocks * p.code_len);
        let draw = |n: usize, fp8: bool, seed: u64| {
            let mut b = self.alloc::<u8>(n);
            // SAFETY (every launch here): argument types and buffer sizes match the kernels.
            ck(
                unsafe {
                    self.stream()
                        .kernel(self.qk.get("rand_bytes"))
                        .arg(&mut b)
                        .arg(&(n as i64))
                        .arg(&(fp8 as i32))
                        .arg(&seed)
                        .launch(cfg1d(n, 256))
                },
                "rand_bytes",
            );
            b
        };
        let mut blocks = draw(n, format == PackedFormat::Fp8, seed);
        if format == PackedFormat::IQ2_XXS {
            // Random sign words hold an odd number of negatives in half their grid entries, which
            // GGUF cannot (its 8th sign is the parity of 7): made even, as GGUF blocks split.
            let ns = n / 8;
            ck(
                unsafe {
                    self.stream()
                        .kernel(self.qk.get("iq2_even_signs_k"))
                        .arg(&mut blocks)
                        .arg(&(ns as i64))
                        .launch(cfg1d(ns, 256))
                },
                "iq2_even_signs_k",
            );
        }
        let f16 = |x: f32| dsv4_model::packed::f16_bits(x) as u32;
        // (offset of d in a head, d, offset of dmin, dmin): d and dmin chosen so values have
        // about `std` (see each format's layout in dsv4_model::quant; the head holds a block's
        // bytes other than its codes, in order; IQ2_XXS's holds d twice, at 2 and 6, see
        // dsv4_model::packed::Planes).
        let patch = match format {
            PackedFormat::Q8_0 => Some((0i32, f16(std / 74.0), -1i32, 0)),
            PackedFormat::Q4_K => Some((0, f16(std / 145.0), 2, f16(std * 7.5 / 145.0))),
            PackedFormat::Q2_K => Some((16, f16(std / 8.4), 18, f16(std * 1.5 / 8.4))),
            PackedFormat::IQ2_XXS => Some((2, f16(std / 50.0), 6, f16(std / 50.0))),
            _ => None,
        };
        let mut scales = match format {
            PackedFormat::Fp8 => {
                let v: Vec<u8> =
                    vec![std / 2.5; format.n_scales(rows, cols)].iter().flat_map(|s: &f32| s.to_le_bytes()).collect();
                ck(self.stream().clone_htod(&v), "upload scales")
            }
            PackedFormat::Fp4 => {
                let ns = format.n_scales(rows, cols);
                let mut s = self.alloc::<u8>(ns);
                let e = (127.0 + (std / 2.93).log2().round()).clamp(1.0, 254.0) as u32;
                ck(
                    unsafe {
                        self.stream()
                            .kernel(self.qk.get("fill_u8"))
                            .arg(&mut s)
                            .arg(&(ns as i64))
                            .arg(&e)
                            .launch(cfg1d(ns, 256))
                    },
                    "fill_u8",
                );
                s
            }
            _ => draw(nblocks * planes.expect("a GGUF format").head_len(), false, seed ^ 0x5eed),
        };
        if let (Some((o1, v1, o2, v2)), Some(p)) = (patch, planes) {
            let (nb, bb) = (nblocks, p.head_len() as i32);
            ck(
                unsafe {
                    self.stream()
                        .kernel(self.qk.get("patch_blocks"))
                        .arg(&mut scales)
                        .arg(&(nb as i64))
                        .arg(&bb)
                        .arg(&o1)
                        .arg(&v1)
                        .arg(&o2)
                        .arg(&v2)
                        .launch(cfg1d(nb, 256))
                },
                "patch_blocks",
            );
        }
        // The dense products read their first weight bytes before waiting for the kernel before
        // them (PDL): the weight is complete before any kernel can read it.
        self.synchronize();
        self.note_x8_format(format);
        CudaWeight { rows, cols, data: self.alloc(1), bf: None, q: Some(QuantDev { format, blocks, scales }) }
    }

    fn note_x8_format(&self, f: PackedFormat) {
        // The RMSNorms start writing int8 twins: steps recorded before record again.
        if crate::x8::supports(f) && !self.x8_weights.swap(true, std::sync::atomic::Ordering::Relaxed) {
            self.bump_settings();
        }
    }

    /// A packed weight as the host holds it (GGUF blocks joined again from their planes; FP8 /
    /// FP4 scales as f32), `None` for a weight that is not packed.
    pub fn download_packed(&self, w: &CudaWeight) -> Option<Packed> {
        let q = w.q.as_ref()?;
        let (codes, raw) = (self.download(&q.blocks), self.download(&q.scales));
        let (blocks, scales) = match q.format {
            PackedFormat::Fp8 => {
                (codes, raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
            }
            PackedFormat::Fp4 => (codes, raw.iter().map(|&e| f32::from_bits((e as u32) << 23)).collect()),
            f => match f.planes().expect("a GGUF format").join(&codes, &raw) {
                Ok(b) => (b, Vec::new()),
                Err(e) => panic!("download of packed {} planes: {e}", f.name()),
            },
        };
        Some(Packed { format: q.format, blocks, scales })
    }

    /// `out[n, m] = x · wᵀ` for a packed `w` `[m, k]` (`groups > 1`: the grouped projection).
    pub(crate) fn matmul_packed(&self, x: &CudaTensor, q: &QuantDev, m: usize, k: usize, groups: usize) -> CudaTensor {
        self.matmul_packed_twin(x, q, m, k, groups, false)
    }

    /// [`CudaBackend::matmul_packed`]; with `twin`, a one-row product on int8 activations also
    /// writes its output's int8 codes (`gemv1xq`, kept on the result as [`CudaTensor::x8`]) where
    /// [`CudaBackend::set_gemv_twin`] is on: the next int8 product of it (wo_b of wo_a's) then
    /// needs no `quant_x8` launch.
    pub(crate) fn matmul_packed_twin(
        &self,
        x: &CudaTensor,
        q: &QuantDev,
        m: usize,
        k: usize,
        groups: usize,
        twin: bool,
    ) -> CudaTensor {
        let n = x.rows;
        assert_eq!(x.cols, groups * k, "packed product: input width {} vs {groups} × {k}", x.cols);
        if n > self.x8_rows() && !self.exact() {
            if let Some(out) = self.pgemm_dense(x, q, m, k, groups) {
                return out;
            }
            let bf = self.dequant_bf16(q, m, k);
            let out = self.matmul_bf16(x, &bf, m, k, groups);
            // Freed on the main stream: inside a side branch, after the side's kernels that read it.
            self.side_fence();
            return out;
        }
        let mut out = self.tensor(n, m);
        if n == 0 || m == 0 {
            return out;
        }
        let cfg = LaunchConfig {
            grid_dim: (m.div_ceil(Q_WARPS) as u32, 1, 1),
            block_dim: (32 * Q_WARPS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let blk = crate::x8::BLOCK;
        if self.int8() && crate::x8::supports(q.format) && k.is_multiple_of(blk) && x.cols.is_multiple_of(blk) {
            let opw = if n == 1 { x8_opw().gemv } else { 1 };
            assert!((m / groups).is_multiple_of(opw), "packed product: {} rows a group vs {opw} a warp", m / groups);
            // Tiles of 16 outputs must not straddle two groups' activations.
            let tiles = n >= TILE_MIN_ROWS
                && self.x8_tiles() != X8Tiles::Off
                && (groups == 1 || (m / groups).is_multiple_of(TILE_OUTPUTS));
            // 2–4 rows at two outputs a warp (gemvx2p / gemvx4p: a warp's two weight rows share
            // each activation load).
            let pairs =
                !tiles && (2..=4).contains(&n) && self.row_caps() && self.row_pairs() && (m / groups).is_multiple_of(2);
            let (kernel, cfg) = if tiles {
                let (nt, w) = tile_gemv(n, m);
                let (gx, gy) = (n.div_ceil(TILE_ROWS * nt), m.div_ceil(TILE_OUTPUTS));
                let grid = (gx as u32, gy.div_ceil(tile_rounds(gx * gy)) as u32, 1);
                // The cp.async form: Q8_0 with each row's scale pairs 4-byte aligned (k / 32 even).
                let cp = self.tile_cp() && q.format == PackedFormat::Q8_0 && (k / blk).is_multiple_of(2);
                let smem = if cp { xtc_smem(nt, w) as u32 } else { 0 };
                let cfg = LaunchConfig { grid_dim: grid, block_dim: (32 * w as u32, 1, 1), shared_mem_bytes: smem };
                (self.qk.of(&format!("{}{nt}{w}", if cp { "gemvtc" } else { "gemvt" }), q.format), cfg)
            } else if n == 1 && self.gemv4_fits(k, m / groups) {
                let cfg = LaunchConfig { grid_dim: (m.div_ceil(Q_WARPS * 4) as u32, 1, 1), ..cfg };
                (self.qk.of("gemv1x4", q.format), cfg)
            } else if pairs {
                let cfg = LaunchConfig { grid_dim: (m.div_ceil(Q_WARPS * 2) as u32, 1, 1), ..cfg };
                (self.qk.of(if n == 2 { "gemvx2p" } else { "gemvx4p" }, q.format), cfg)
            } else {
                let cfg = LaunchConfig { grid_dim: (m.div_ceil(Q_WARPS * opw) as u32, 1, 1), ..cfg };
                (self.qk.of(gemvx_name(n, self.row_caps()), q.format), cfg)
            };
            let X8Twin { q: xq, d: xd } = self.x8_of(x);
            let blk = crate::x8::BLOCK;
            // quant_groups needs the outputs a block (8·opw) to divide 32 or be a multiple of it.
            let groups_fit = matches!(opw, 1 | 2 | 4 | 8) && m.is_multiple_of(blk) && m / blk <= FFN1_COUNTERS;
            if twin && n == 1 && !tiles && self.gemv_twin() && groups_fit {
                let (mut oq, mut od) = (self.alloc::<i8>(m), self.alloc::<f32>(m / blk));
                // SAFETY: argument types and buffer sizes match the kernel: out holds m values,
                // oq / od their m codes and m / 32 scales, the counters (zero between launches)
                // cover the m / 32 groups; xq as below.
                ck(
                    unsafe {
                        self.stream()
                            .kernel(self.qk.of("gemv1xq", q.format))
                            .arg(&mut out.data)
                            .arg(&mut oq)
                            .arg(&mut od)
                            .arg(self.counters())
                            .arg(xq)
                            .arg(xd)
                            .arg(&q.blocks)
                            .arg(&q.scales)
                            .arg(&(k as i32))
                            .arg(&(m as i32))
                            .arg(&((m / groups) as i32))
                            .launch(LaunchConfig { grid_dim: (m.div_ceil(Q_WARPS * opw) as u32, 1, 1), ..cfg })
                    },
                    "gemv packed int8 with its output's codes",
                );
                let _ = out.x8.set(X8Twin { q: oq, d: od });
                return out;
            }
            // 2–4 rows at two outputs a warp with their outputs' codes too (gemvx2pq / gemvx4pq:
            // the same arguments after out, then the codes, scales and counters).
            let mut codes = (twin && pairs && self.gemv_twin() && m.is_multiple_of(blk) && m / blk <= FFN1_COUNTERS)
                .then(|| (self.alloc::<i8>(n * m), self.alloc::<f32>(n * m / blk)));
            let kernel = if codes.is_some() {
                self.qk.of(if n == 2 { "gemvx2pq" } else { "gemvx4pq" }, q.format)
            } else {
                kernel
            };
            // SAFETY: argument types and buffer sizes match the kernel; xq holds the rows'
            // codes (16-byte aligned: a fresh allocation, rows and chunks of multiples of 32).
            // gemvtc's 16- and 4-byte cp.async copies read the codes and scales from their own
            // allocations, rows of k (a multiple of 32) and k / 16 bytes (k / 32 even: a multiple
            // of 4), and the launch carries the ring `xtc_smem` sizes, its function attribute set
            // at load. With codes: oq / od hold the n · m codes and n · m / 32 scales of out's
            // n · m values, the counters (zero between launches) cover the m / 32 groups.
            let mut l = self.stream().kernel(kernel);
            l.arg(&mut out.data);
            if let Some((oq, od)) = codes.as_mut() {
                l.arg(oq).arg(od).arg(self.counters());
            }
            l.arg(xq).arg(xd).product_args(&q.blocks, &q.scales, [n, k, m, x.cols, m / groups]);
            ck(unsafe { l.launch(cfg) }, "gemv packed int8");
            if let Some((q, d)) = codes {
                let _ = out.x8.set(X8Twin { q, d });
            }
            return out;
        }
        // Many rows: gemvo, bitwise gemv, a warp's activation loads shared by GEMVO_OUTS outputs.
        let (name, cfg) = if n >= GEMVO_MIN_ROWS && (m / groups).is_multiple_of(GEMVO_OUTS) && self.gemvo() {
            let grid = (m.div_ceil(Q_WARPS * GEMVO_OUTS) as u32, n.div_ceil(GEMVO_ROWS) as u32, 1);
            ("gemvo", LaunchConfig { grid_dim: grid, ..cfg })
        } else {
            (if n == 1 { "gemv1" } else { "gemv" }, cfg)
        };
        // SAFETY: argument types and buffer sizes match the kernel.
        ck(
            unsafe {
                self.stream()
                    .kernel(self.qk.of(name, q.format))
                    .arg(&mut out.data)
                    .arg(&x.data)
                    .product_args(&q.blocks, &q.scales, [n, k, m, x.cols, m / groups])
                    .launch(cfg)
            },
            "gemv packed",
        );
        out
    }

    /// The int8 codes and per-32 scales of the first `len` values of `x` (`len` a multiple of
    /// 32; [`crate::x8::quantize`] is the CPU twin).
    /// `x`'s int8 twin: the one its producer wrote, or `quant_x8` of it now (kept with `x`, so
    /// the next product on `x` reuses it).
    pub(crate) fn x8_of<'t>(&self, x: &'t CudaTensor) -> &'t X8Twin {
        let made_here = x.x8.get().is_none();
        let t = x.x8.get_or_init(|| {
            let (q, d) = self.quant_x8(&x.data, x.rows * x.cols);
            X8Twin { q, d }
        });
        if made_here {
            // Kept with `x`, which the main chain may read before a side branch's join.
            self.side_fence();
        }
        t
    }

    pub(crate) fn quant_x8(&self, x: &CudaSlice<f32>, len: usize) -> (CudaSlice<i8>, CudaSlice<f32>) {
        assert!(len.is_multiple_of(crate::x8::BLOCK) && x.len() >= len, "quant_x8: {len} values");
        let mut xq = self.alloc::<i8>(len);
        let mut xd = self.alloc::<f32>(len / crate::x8::BLOCK);
        if len > 0 {
            // SAFETY: argument types and buffer sizes match the kernel (one warp per block of 32).
            ck(
                unsafe {
                    self.stream()
                        .kernel(self.qk.get("quant_x8"))
                        .arg(&mut xq)
                        .arg(&mut xd)
                        .arg(x)
                        .arg(&((len / crate::x8::BLOCK) as i64))
                        .launch(cfg1d(len, 256))
                },
                "quant_x8",
            );
        }
        (xq, xd)
    }

    /// The products of `ws` (one row, or 2 to 4) in one launch where every weight is
    /// [`CudaBackend::x8_groupable`] and all share a format (2 to [`XG_MAX`] of them), else
    /// `None`. [`crate::Backend::matmul_many`] takes this path when [`CudaBackend::set_x8_group`]
    /// is on; tests call it directly.
    pub fn matmul_grouped_x8(&self, x: &CudaTensor, ws: &[&CudaWeight]) -> Option<Vec<CudaTensor>> {
        let group: Vec<_> = ws
            .iter()
            .map(|w| w.q.as_ref().filter(|q| self.x8_groupable(x, q, w.rows, w.cols)).map(|q| (q, w.rows)))
            .collect::<Option<_>>()?;
        let same = group.iter().all(|(q, _)| q.format == group[0].0.format);
        (same && (2..=XG_MAX).contains(&group.len())).then(|| self.matmul_x8_many(x, &group))
    }

    /// Whether a one-row int8 product of `k` inputs and `rpg` outputs a group takes the kernels
    /// of 4 outputs a warp and one chunk a lane ahead (`gemv1x4`, `gemv1xg4`;
    /// [`CudaBackend::set_gemv4`]): at k ≤ 1024 a lane holds one 32-value chunk a row, so four
    /// rows cost few registers, and wq_b's 32,768 outputs take 8,192 warps (~2 waves on the H200)
    /// instead of 32,768 (~7.5 waves, each waiting a DRAM round trip: 14.9 µs at 52 % of DRAM).
    pub fn gemv4_fits(&self, k: usize, rpg: usize) -> bool {
        self.gemv4() && k <= 1024 && rpg.is_multiple_of(4)
    }

    /// Whether [`CudaBackend::matmul_x8_many`] takes `w` (`[m, k]` packed) for `x`: one row, or
    /// 2 to 4 where their products take two outputs a warp ([`CudaBackend::set_row_pairs`]).
    pub(crate) fn x8_groupable(&self, x: &CudaTensor, q: &QuantDev, m: usize, k: usize) -> bool {
        let blk = crate::x8::BLOCK;
        let rows = match x.rows {
            1 => m.is_multiple_of(x8_opw().gemv),
            2..=4 => self.row_caps() && self.row_pairs() && m.is_multiple_of(2),
            _ => false,
        };
        rows && (x.rows <= self.x8_rows() || self.exact())
            && x.cols == k
            && self.int8()
            && crate::x8::supports(q.format)
            && k.is_multiple_of(blk)
            && m > 0
    }

    /// The products `x · w_iᵀ` of packed weights of one int8 format (each
    /// [`CudaBackend::x8_groupable`]) in one launch (`gemv1xg`, or `gemvxg4p` for 2 to 4 rows):
    /// each result bitwise [`crate::Backend::matmul`]'s. The attention input's wq_a and wkv, and
    /// qr's wq_b and the indexer's wq_b, ran a launch each (1,024 / 512 outputs: ~5 µs latency
    /// chains), in a decode step and in a DSpark verify alike.
    pub(crate) fn matmul_x8_many(&self, x: &CudaTensor, ws: &[(&QuantDev, usize)]) -> Vec<CudaTensor> {
        assert!((2..=XG_MAX).contains(&ws.len()), "{} int8 products in one launch", ws.len());
        let format = ws[0].0.format;
        assert!(ws.iter().all(|(q, _)| q.format == format), "one format a grouped launch");
        let n = x.rows;
        let four = n == 1 && ws.iter().all(|&(_, m)| self.gemv4_fits(x.cols, m));
        let per = Q_WARPS
            * if n > 1 {
                2
            } else if four {
                4
            } else {
                x8_opw().gemv
            };
        let outs: Vec<CudaTensor> = ws.iter().map(|&(_, m)| self.tensor(n, m)).collect();
        let mut g = X8Group::default();
        let mut blocks = 0usize;
        for (i, (&(q, m), o)) in ws.iter().zip(&outs).enumerate() {
            g.w[i] = self.dev_ptr(&q.blocks);
            g.s[i] = self.dev_ptr(&q.scales);
            g.out[i] = self.dev_ptr(&o.data);
            g.m[i] = m as i32;
            g.b0[i] = blocks as i32;
            blocks += m.div_ceil(per);
        }
        g.b0[ws.len()] = blocks as i32;
        g.count = ws.len() as i32;
        let X8Twin { q: xq, d: xd } = self.x8_of(x);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (32 * Q_WARPS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument types match the kernels (X8Group is quant.cu's struct); entry i's
        // codes and heads hold m_i rows of k inputs, its output n·m_i floats (m_i even where
        // n > 1: x8_groupable), and xq / xd the n rows' k codes and k / 32 scales each (16-byte
        // aligned: a fresh allocation).
        ck(
            unsafe {
                if n > 1 {
                    let mut l = self.stream().kernel(self.qk.of("gemvxg4p", format));
                    l.arg_struct(&g).arg(xq).arg(xd).arg(&(n as i32)).arg(&(x.cols as i32)).launch(cfg)
                } else {
                    let mut l = self.stream().kernel(self.qk.of(if four { "gemv1xg4" } else { "gemv1xg" }, format));
                    l.arg_struct(&g).arg(xq).arg(xd).arg(&(x.cols as i32)).launch(cfg)
                }
            },
            "gemv1xg",
        );
        outs
    }

    /// The bf16 values of a packed `[rows, cols]` weight (the large-batch path).
    pub(crate) fn dequant_bf16(&self, q: &QuantDev, rows: usize, cols: usize) -> CudaSlice<u16> {
        let out = self.alloc::<u16>(rows * cols);
        self.dequant_bf16_into(self.dev_ptr(&out), q, rows, cols);
        out
    }

    /// [`Self::dequant_bf16`] into `rows · cols` bf16 values at device address `dst`.
    pub(crate) fn dequant_bf16_into(&self, dst: u64, q: &QuantDev, rows: usize, cols: usize) {
        let chunks = rows * cols / 8;
        // SAFETY: `dst` holds rows·cols bf16 values (callers' buffers); the rest match the kernel.
        ck(
            unsafe {
                self.stream()
                    .kernel(self.qk.of("deq_bf16", q.format))
                    .arg(&dst)
                    .arg(&q.blocks)
                    .arg(&q.scales)
                    .arg(&(rows as i64))
                    .arg(&(cols as i32))
                    .launch(cfg1d(chunks, 256))
            },
            "deq_bf16",
        );
    }

    /// The up / down kernels of routed experts held packed (or bf16 beside packed ones, where
    /// a matrix's rows are not whole blocks) and their 6·E address table (w1, w3, w2 blocks,
    /// then scales).
    /// `rows`: the call's token rows, a bound on each expert's pairs where a row's experts are
    /// distinct (a learned router's top-k; a hash table may repeat one, and the capped kernels
    /// then take its pairs in more groups, with the same values): one row takes the one-row
    /// kernels, 2 or 4 the int8 down kernels built for that many (`moe_downx2`, `moe_downx4`:
    /// fewer registers, the same values).
    /// `full`: the experts hold enough pairs each for the int8 tiles ([`CudaBackend::expert_tiles`]).
    pub(crate) fn packed_expert_kernels(
        &self,
        experts: &[dsv4_model::weights::Expert<CudaWeight>],
        rows: usize,
        full: bool,
    ) -> ExpertKernels<'_> {
        let single = rows == 1;
        // Kernel suffix, block address and scale address of one matrix.
        let parts = |w: &CudaWeight| match (&w.q, &w.bf) {
            (Some(q), _) => (suffix(q.format), self.dev_ptr(&q.blocks), self.dev_ptr(&q.scales)),
            (None, Some(bf)) => ("bf16w", self.dev_ptr(bf), self.dev_ptr(bf)),
            (None, None) => panic!("routed expert neither packed nor bf16"),
        };
        let (f13, f2) = (parts(&experts[0].w1).0, parts(&experts[0].w2).0);
        let mut ptrs = vec![0u64; 6 * experts.len()];
        let ne = experts.len();
        for (e, ex) in experts.iter().enumerate() {
            for (i, w) in [&ex.w1, &ex.w3, &ex.w2].into_iter().enumerate() {
                let (f, blocks, scales) = parts(w);
                assert_eq!(
                    f,
                    if i < 2 { f13 } else { f2 },
                    "expert {e}: every routed expert of a layer must share one format for w1/w3 and one for w2"
                );
                ptrs[i * ne + e] = blocks;
                ptrs[(3 + i) * ne + e] = scales;
            }
        }
        let r = if single { "1" } else { "" };
        let int8 = |w: &CudaWeight| w.q.as_ref().is_some_and(|q| crate::x8::supports(q.format));
        let ex = &experts[0];
        let x8_tiles = !single && (self.x8_tiles() == X8Tiles::All || (full && self.x8_tiles() == X8Tiles::Dense));
        let x = if x8_tiles { "t" } else { "x" };
        // The down kernel capped at 2 or 4 pairs an expert (not for the tiles).
        let cap = match rows {
            2 if !x8_tiles && self.row_caps() => "2",
            3 | 4 if !x8_tiles && self.row_caps() => "4",
            _ => "",
        };
        let x8 = (self.int8() && int8(&ex.w1) && int8(&ex.w3) && int8(&ex.w2))
            .then(|| (self.qk.get(&format!("moe_up{r}{x}_{f13}")), self.qk.get(&format!("moe_down{r}{x}{cap}_{f2}"))));
        ExpertKernels {
            up: self.qk.get(&format!("moe_up{r}_{f13}")),
            down: self.qk.get(&format!("moe_down{r}_{f2}")),
            table: self.address_table(ptrs),
            x8,
            x8_tiles,
            pg_up: self.qk.get(&format!("pgemm_up64_{f13}")),
            pg_down: self.qk.get(&format!("pgemm_down64_{f2}")),
            pg_up128: self.qk.get(&format!("pgemm_up128_{f13}")),
            pg_down128: self.qk.get(&format!("pgemm_down128_{f2}")),
            pg_up128w: self.qk.get(&format!("pgemm_up128w_{f13}")),
            pg_down128w: self.qk.get(&format!("pgemm_down128w_{f2}")),
        }
    }

    /// `out[i, :] = table[tokens[i], :]` for a bf16 table.
    pub(crate) fn gather_bf16(
        &self,
        out: &mut CudaTensor,
        table: &CudaSlice<u16>,
        idx: &cudarc::driver::CudaView<'_, u32>,
        n: usize,
        cols: usize,
    ) {
        // SAFETY: argument types and buffer sizes match the kernel.
        ck(
            unsafe {
                self.stream()
                    .kernel(self.qk.get("gather_bf16"))
                    .arg(out.data_mut())
                    .arg(table)
                    .arg(idx)
                    .arg(&(n as i32))
                    .arg(&(cols as i32))
                    .launch(cfg1d(n * cols, 256))
            },
            "gather_bf16",
        );
    }
}

#[cfg(test)]
mod tests {
    use super::{x8_opw_of, PackedFormat, X8Opw};

    #[test]
    fn outputs_a_warp_default_to_four_only_in_the_two_launch_experts() {
        let d = x8_opw_of(None);
        assert_eq!(d, X8Opw { gemv: 1, up: 1, down: 1, downn: 1, up1s: 4, down1s: 4 });
        assert_eq!(d.up1s_for(PackedFormat::IQ2_XXS), 4);
        assert_eq!((d.up1s_for(PackedFormat::Q8_0), d.up1s_for(PackedFormat::Q2_K)), (1, 1));
        // DSV4_X8_OPW sets both expert forms (1,1,1 is the form before v49).
        let old = x8_opw_of(Some("1,1,1"));
        assert_eq!((old.up1s, old.down1s, old.downn), (1, 1, 1));
        let s = x8_opw_of(Some("2, 4, 2, 2"));
        assert_eq!(s, X8Opw { gemv: 2, up: 4, down: 2, downn: 2, up1s: 4, down1s: 2 });
        // Six fields set the two-launch pair apart (gemv4 against the default's experts).
        let g4 = x8_opw_of(Some("4,1,1,1,4,4"));
        assert_eq!(g4, X8Opw { gemv: 4, ..d });
        for bad in ["1,9,1", "1,1", "1,x,1", "1,1,1,3", "1,1,1,1,4", "1,1,1,1,4,9", ""] {
            assert_eq!(x8_opw_of(Some(bad)), d, "{bad:?}");
        }
    }
}
