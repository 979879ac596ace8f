//! Launchers of `kernels/gemm.cu`: products of many rows (prefill chunks, decode batches above
//! the int8 path's rows) on tensor cores, the weight dequantised to bf16 inside the tile load.
//!
//! They replace, for packed and bf16-beside-packed weights, the path that dequantised every
//! weight to a bf16 scratch and ran cuBLAS (dense products), or read the expert offsets back and
//! ran two cuBLAS products per active expert (routed experts): the same bf16 operands and f32
//! sums, no scratch, no host synchronisation, two launches for all experts. `DSV4_PGEMM=0`
//! restores the earlier path (A/B). Dense products take the tiles up to
//! [`CudaBackend::tiles_dense_rows`] rows (128 by default: cuBLAS on the scratch wins at 256
//! rows and more with today's tiles). The routed experts' 128-row tiles run on Hopper's wgmma
//! (`DSV4_PGEMM_WGMMA=0`, [`CudaBackend::set_pgemm_wgmma`]: on mma.sync instead).

use super::launch::Kernel;
use super::quant::{ExpertKernels, QuantDev};
use super::{ck, CudaBackend, CudaTensor};
use cudarc::driver::{CudaSlice, CudaView, LaunchConfig};

/// Default of [`CudaBackend::tiles_dense_rows`]: dense packed products of up to this many rows
/// (above the int8 path's) take the tiles.
pub const TILES_DENSE_ROWS: usize = 128;

/// Rows of a dense product's tile (gemm.cu's `pgemm_F`).
pub const PG_BM: usize = 128;
/// `PG_BN`, `PG_BK` of gemm.cu: weight rows of a block's tile, values a stage.
pub const PG_BN: usize = 128;
pub const PG_BK: usize = 64;

/// Dynamic shared memory of a tile kernel of `bm` rows: two stages of activations and weights,
/// rows of `PG_BK + 8` bf16 (gemm.cu's `PG_LD`).
pub(crate) const fn pg_smem(bm: usize) -> usize {
    2 * (bm + PG_BN) * (PG_BK + 8) * 2
}

/// Dynamic shared memory of the wgmma tiles (`pgemm_{up,down}128w`): two stages of 128 rows and
/// PG_BN weight rows of `PG_BK` bf16 (128-byte swizzled rows, no padding), and 1024 bytes to
/// align the swizzle atoms.
pub(crate) const PGW_SMEM: usize = 2 * (128 + PG_BN) * PG_BK * 2 + 1024;

/// The most dynamic shared memory any tile kernel takes (set on each at load).
pub(crate) const PG_SMEM_MAX: usize = if PGW_SMEM > pg_smem(128) { PGW_SMEM } else { pg_smem(128) };

/// Whether products of many rows take the tensor-core tiles (default) or, with `DSV4_PGEMM=0`,
/// the dequantised scratch and cuBLAS.
pub fn pgemm_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("DSV4_PGEMM").map(|v| v != "0").unwrap_or(true))
}

/// The routed experts' sorted pairs (moe_sort's `order` and `off`) and their shape.
pub(crate) struct SortedPairs<'a> {
    pub order: CudaView<'a, u32>,
    pub off: CudaView<'a, u32>,
    /// Experts held here, slots a row, model width, expert width.
    pub nexp: usize,
    pub k: usize,
    pub d: usize,
    pub inter: usize,
}

/// Whether [`CudaBackend::pgemm_experts`] takes experts of this shape.
pub(crate) fn experts_fit(d: usize, inter: usize) -> bool {
    pgemm_on()
        && d.is_multiple_of(PG_BN)
        && inter.is_multiple_of(PG_BN / 2)
        && d.is_multiple_of(PG_BK)
        && inter.is_multiple_of(PG_BK)
}

/// Splits of k for a dense product of `m` outputs over `k` values on the tiles, and the values
/// a split takes (a multiple of `PG_BK`): enough blocks for two waves of a row tile over `sms`
/// multiprocessors, each split at least 4 stages. From the shape alone, so a row's sums are the
/// same in every batch. A 1,024 × 4,096 product (V4-Flash's wq_a) ran as 8 blocks walking 64
/// stages (80 µs at batch 64 on the H200, PERF.md v19); in 16 splits it runs 128 blocks of 4.
/// `DSV4_PGEMM_SPLIT=0` turns the split off (A/B).
pub(crate) fn dense_splits(m: usize, k: usize, sms: usize) -> (usize, usize) {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if !*ON.get_or_init(|| std::env::var("DSV4_PGEMM_SPLIT").map_or(true, |v| v.trim() != "0")) {
        return (1, k);
    }
    let tiles = m.div_ceil(PG_BN).max(1);
    let stages = (k / PG_BK).max(1);
    let want = (2 * sms).div_ceil(tiles).clamp(1, (stages / 4).max(1));
    let per = stages.div_ceil(want);
    (stages.div_ceil(per), per * PG_BK)
}

impl CudaBackend {
    /// `out[n, m] = x · wᵀ` for a packed `w` `[m, k]` (`groups > 1`: the grouped projection) on
    /// the tensor-core tiles; `None` for shapes they do not take, or above the tiles' rows.
    pub(crate) fn pgemm_dense(
        &self,
        x: &CudaTensor,
        q: &QuantDev,
        m: usize,
        k: usize,
        groups: usize,
    ) -> Option<CudaTensor> {
        let (n, rpg) = (x.rows, m / groups);
        let fits = k.is_multiple_of(PG_BK)
            && m.is_multiple_of(2)
            && x.cols.is_multiple_of(4)
            && (groups == 1 || rpg.is_multiple_of(PG_BN));
        if !pgemm_on() || n > self.tiles_dense_rows() || !fits {
            return None;
        }
        let mut out = self.tensor(n, m);
        if n == 0 || m == 0 {
            return Some(out);
        }
        // Tiles of 64 rows for up to 64 (half the mma work of 128; each output's sum is the
        // same either way), and the split of k from the shape alone (see `dense_splits`).
        let (bm, kern) = if n <= 64 { (64, "pgemm64") } else { (PG_BM, "pgemm") };
        let (splits, ks) = dense_splits(m, k, self.sm_count());
        let mut part = if splits > 1 { Some(self.scratch::<f32>(splits * n * m)) } else { None };
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(bm) as u32, m.div_ceil(PG_BN) as u32, splits as u32),
            block_dim: (256, 1, 1),
            shared_mem_bytes: pg_smem(bm) as u32,
        };
        // SAFETY: argument types and buffer sizes match the kernel; x's rows are 16-byte aligned
        // (a fresh allocation, cols a multiple of 4); `part` holds splits × n × m values when
        // splits > 1 (the kernel writes `out` directly otherwise and never reads `part`).
        ck(
            unsafe {
                let mut l = self.stream().kernel(self.qk.of(kern, q.format));
                l.arg(&mut out.data);
                match part.as_mut() {
                    Some(p) => l.arg(p),
                    None => l.arg(&mut out.data),
                };
                l.arg(&x.data).product_args(&q.blocks, &q.scales, [n, k, m, x.cols, rpg]).arg(&(ks as i32)).launch(cfg)
            },
            "pgemm",
        );
        if let Some(p) = part.as_ref() {
            let count = n * m;
            // SAFETY: `p` holds splits × count values, `out` count.
            ck(
                unsafe {
                    self.stream()
                        .kernel(self.qk.get("pg_sum_splits"))
                        .arg(&mut out.data)
                        .arg(p)
                        .arg(&(splits as i32))
                        .arg(&(count as i64))
                        .launch(super::cfg1d(count, 256))
                },
                "pg_sum_splits",
            );
        }
        Some(out)
    }

    /// Routed experts on the tensor-core tiles: `y[p, :]` (a row of `d` per pair p of `pairs`)
    /// = `w2_e · SwiGLU(w1_e · x_t, w3_e · x_t)` for pair p's expert e and token t = p / k, in
    /// four launches (tile list, gate/up, down; the caller combines) whatever the routing.
    pub(crate) fn pgemm_experts(
        &self,
        ek: &ExpertKernels<'_>,
        x: &CudaTensor,
        p: &SortedPairs<'_>,
        y: &mut CudaSlice<f32>,
        limit: f32,
    ) {
        let nk = x.rows * p.k;
        // Tiles of 128 of an expert's pairs where experts hold 96 or more on average (prefill
        // chunks of ~4K tokens and up: half the decode work a product), else of 64.
        let bm = if nk >= 96 * p.nexp { 128 } else { 64 };
        let wgmma = bm == 128 && self.pgemm_wgmma();
        let (up, down, smem) = match (bm, wgmma) {
            (128, true) => (ek.pg_up128w, ek.pg_down128w, PGW_SMEM),
            (128, false) => (ek.pg_up128, ek.pg_down128, pg_smem(128)),
            _ => (ek.pg_up, ek.pg_down, pg_smem(bm)),
        };
        // Every active expert's last tile may be partial: at most ⌈nk / bm⌉ + active tiles.
        let most = nk.div_ceil(bm) + nk.min(p.nexp);
        let mut tiles = self.alloc::<u32>(1 + most);
        let mut h = self.alloc::<u16>(nk * p.inter);
        let (nei, ki, di, ii) = (p.nexp as i32, p.k as i32, p.d as i32, p.inter as i32);
        let grid = |cols: usize| LaunchConfig {
            grid_dim: (most as u32, cols as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // The gate/up tiles read bf16 activations: one cast for all the experts' tiles.
        assert_eq!(x.cols, p.d, "routed experts: input width {} vs d {}", x.cols, p.d);
        let xb = self.bf16_of(x);
        // SAFETY (the three launches): argument types and buffer sizes match the kernels; tiles
        // holds the count and at most `most` entries, h a bf16 row of `inter` per pair, y a row
        // of `d` per pair.
        ck(
            unsafe {
                self.stream()
                    .kernel(self.qk.get("moe_tiles"))
                    .arg(&mut tiles)
                    .arg(&p.off)
                    .arg(&nei)
                    .arg(&(bm as i32))
                    .launch(LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 })
            },
            "moe_tiles",
        );
        ck(
            unsafe {
                self.stream()
                    .kernel(up)
                    .arg(&mut h)
                    .arg(&*xb)
                    .arg(&p.order)
                    .arg(&p.off)
                    .arg(&tiles)
                    .arg(ek.table.as_ref())
                    .arg(&nei)
                    .arg(&ki)
                    .arg(&di)
                    .arg(&ii)
                    .arg(&limit)
                    .launch(grid(p.inter / (PG_BN / 2)))
            },
            "pgemm_up",
        );
        ck(
            unsafe {
                self.stream()
                    .kernel(down)
                    .arg(y)
                    .arg(&h)
                    .arg(&p.order)
                    .arg(&p.off)
                    .arg(&tiles)
                    .arg(ek.table.as_ref())
                    .arg(&nei)
                    .arg(&di)
                    .arg(&ii)
                    .launch(grid(p.d / PG_BN))
            },
            "pgemm_down",
        );
    }
}
