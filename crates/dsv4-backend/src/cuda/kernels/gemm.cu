// ---- Products of many rows on tensor cores (prefill chunks, large decode batches): compiled
// after quant.cu in one module (its formats, raw8 / deq8r and f2bf_q). Launchers: cuda/gemm.rs.
//
// A block computes a tile of BM rows × PG_BN weight rows. Each stage of PG_BK values: every
// thread loads its share of the rows' activations (f32 or bf16) and of the weight rows' packed
// words (raw8) for the next stage, the warps run the current stage's `mma.m16n8k16` (bf16 in,
// f32 accumulation) from shared memory, then the loaded words are decoded (deq8r), rounded to
// bf16 (nearest even, deq_bf16's bits) and stored into the other buffer. So the weight is
// dequantised once per row tile inside the tile load, never to a global scratch, and the
// numerics are the bf16 path's that these kernels replace (weights and activations rounded to
// bf16, f32 sums): only the order of the f32 additions differs. CPU twin: the dequantised
// weight rounded to bf16 against activations rounded to bf16
// (cuda_packed::cuda_prefill_tiles_match_the_bf16_twin).
//
// Routed experts: `moe_tiles` lists (expert, row tile) pairs from moe_sort's offsets on the
// device, and the grids are sized to the most tiles any routing can give, so no size comes back
// to the host: blocks past the list's count return at once.

// Rows a block: BM = 64 or 128 (a template parameter); each weight value is decoded once for
// BM rows, so the decode's instructions per mma halve from 64 to 128.
#define PG_BN 128  // weight rows a block (the up kernel: 64 outputs, gate and up interleaved)
#ifndef PG_BK
#define PG_BK 64   // values a stage (32 or 64)
#endif
#define PG_LD (PG_BK + 8)  // bf16 a shared row: ldmatrix's 8 row addresses hit 8 bank groups
// Blocks an SM the expert kernels are compiled for: 2 caps registers at 128 (a few bytes of
// spills at BM = 128), measured 3–5 % faster than 1 on 4 q2 layers (PERF.md v18).
#ifndef PG_MINB
#define PG_MINB 2
#endif

// ldsm_x4, mma_bf16_16816 and bf2 (cvt.rn.bf16x2: f2bf_q's bits for every non-NaN value): common.cuh.

// Eight activations of a row as four bf16 pairs: f32 (rounded here, as cast_bf16) or bf16.
template <bool XB>
struct XRaw8 {
    float4 a, b;
    __device__ __forceinline__ void load(const void* row, int c) {
        if (!row) {
            a = b = make_float4(0.f, 0.f, 0.f, 0.f);
        } else if (XB) {
            uint4 u = *(const uint4*)((const u16*)row + c);
            a = make_float4(__uint_as_float(u.x), __uint_as_float(u.y), __uint_as_float(u.z), __uint_as_float(u.w));
        } else {
            a = *(const float4*)((const float*)row + c);
            b = *(const float4*)((const float*)row + c + 4);
        }
    }
    __device__ __forceinline__ uint4 bf16() const {
        if (XB) return make_uint4(__float_as_uint(a.x), __float_as_uint(a.y), __float_as_uint(a.z), __float_as_uint(a.w));
        return make_uint4(bf2(a.x, a.y), bf2(a.z, a.w), bf2(b.x, b.y), bf2(b.z, b.w));
    }
};

// One BM × PG_BN tile over k values (k a multiple of PG_BK). xrow(r) is row r's first
// activation (nullptr past the live rows: zeros); wrow(n, w, s) gives weight row n's codes and
// scale row (rows past the matrix: any valid row, the result unused); epi(r, n, v0, v1) gets
// columns n and n + 1 (n even) of row r. 256 threads; every thread must call it (barriers).
// Shared memory: the kernel's dynamic buffer, pg_smem(BM) bytes.
//
// Loads: a stage's rows are cut into chunks of 8 values, PG_BK / 8 consecutive threads a row, so
// a row's stage is one contiguous run (PG_BK = 64: 128 bytes of bf16 activations): ncu on the
// first version (PG_BK = 32, 4 threads a row, f32 activations) showed L1 at 93 % of its
// throughput and the tensor pipe mostly idle, each load instruction touching 8 rows' lines for
// 16–32 bytes each.
//
// Values kb..ke only (both multiples of PG_BK): a split of k (the dense products' split-K).
template <int F, bool XB, int BM, typename XR, typename WR, typename EPI>
__device__ __forceinline__ void pg_tile_range(int kb, int ke, XR xrow, WR wrow, EPI epi) {
    constexpr int CPR = PG_BK / 8;    // threads (chunks of 8 values) a row's stage
    constexpr int RP = 256 / CPR;     // rows a pass of the 256 threads covers
    constexpr int XS = BM / RP;       // activation chunks a thread loads a stage
    constexpr int WS = PG_BN / RP;    // weight chunks a thread decodes a stage
    constexpr int MI = BM / 32;       // m16 tiles a warp
    extern __shared__ __align__(16) u16 pg_sm[];
    u16(*As)[BM][PG_LD] = (u16(*)[BM][PG_LD])pg_sm;
    u16(*Bs)[PG_BN][PG_LD] = (u16(*)[PG_BN][PG_LD])(pg_sm + 2 * BM * PG_LD);
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int lr = tid / CPR, lc = (tid % CPR) * 8;
    const void* xr[XS];
#pragma unroll
    for (int i = 0; i < XS; i++) xr[i] = xrow(lr + RP * i);
    const u8 *wr[WS], *sr[WS];
#pragma unroll
    for (int i = 0; i < WS; i++) wrow(lr + RP * i, wr[i], sr[i]);
    XRaw8<XB> xa[XS];
    Raw8 ra[WS];
    auto load = [&](int k0) {
#pragma unroll
        for (int i = 0; i < XS; i++) xa[i].load(xr[i], k0 + lc);
#pragma unroll
        for (int i = 0; i < WS; i++) ra[i] = raw8<F>(wr[i], sr[i], k0 + lc);
    };
    auto store = [&](int buf, int k0) {
        float y[8];
#pragma unroll
        for (int i = 0; i < XS; i++) *(uint4*)&As[buf][lr + RP * i][lc] = xa[i].bf16();
#pragma unroll
        for (int i = 0; i < WS; i++) {
            deq8r<F>(ra[i], k0 + lc, y);
            *(uint4*)&Bs[buf][lr + RP * i][lc] =
                make_uint4(bf2(y[0], y[1]), bf2(y[2], y[3]), bf2(y[4], y[5]), bf2(y[6], y[7]));
        }
    };
    // Warp tile: rows (BM / 2)·(warp / 4).., columns 32·(warp % 4)..: MI × 4 mma tiles of 16 × 8.
    int wm = (warp >> 2) * (BM / 2), wn = (warp & 3) * 32;
    float acc[MI][4][4];
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;
    load(kb);
    store(0, kb);
    __syncthreads();
    int nk = (ke - kb) / PG_BK;
#pragma unroll 1
    for (int kt = 0; kt < nk; kt++) {
        int buf = kt & 1;
        if (kt + 1 < nk) load(kb + (kt + 1) * PG_BK);
#pragma unroll
        for (int kk = 0; kk < PG_BK; kk += 16) {
            unsigned a[MI][4], b[2][4];
#pragma unroll
            for (int i = 0; i < MI; i++) ldsm_x4(a[i], &As[buf][wm + 16 * i + (lane & 15)][kk + (lane >> 4) * 8]);
#pragma unroll
            for (int j = 0; j < 2; j++)
                ldsm_x4(b[j], &Bs[buf][wn + 16 * j + (lane & 7) + ((lane >> 4) << 3)][kk + ((lane >> 3) & 1) * 8]);
#pragma unroll
            for (int i = 0; i < MI; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) mma_bf16_16816(acc[i][j], a[i], b[j >> 1][2 * (j & 1)], b[j >> 1][2 * (j & 1) + 1]);
        }
        if (kt + 1 < nk) store(buf ^ 1, kb + (kt + 1) * PG_BK);
        __syncthreads();
    }
    int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int r = wm + 16 * i + g, n = wn + 8 * j + 2 * t;
            epi(r, n, acc[i][j][0], acc[i][j][1]);
            epi(r + 8, n, acc[i][j][2], acc[i][j][3]);
        }
}

// All k values (k a multiple of PG_BK).
template <int F, bool XB, int BM, typename XR, typename WR, typename EPI>
__device__ __forceinline__ void pg_tile(int k, XR xrow, WR wrow, EPI epi) {
    pg_tile_range<F, XB, BM>(0, k, xrow, wrow, epi);
}

// ---- Hopper wgmma version of the 128-row tile (the routed experts' `pgemm_{up,down}128w_F`;
// opt in, `DSV4_PGEMM_WGMMA=1`). Same loads, decode and numerics as pg_tile (bf16 operands,
// f32 sums; only the order of the additions inside the tensor core may differ), but the mma
// reads both operands from shared memory through matrix descriptors: ncu on pg_tile showed the
// ldmatrix traffic (24 ldmatrix.x4 a warp a stage for 64 mma) and its bank conflicts, not the
// tensor pipe, bounding it. The mma is asynchronous, so the tile's decode into the other buffer
// runs while the tensor cores work on this one.
//
// Block: 256 threads = 2 warpgroups; warpgroup g owns rows 64g..64g+63 × all 128 weight rows
// (4 m64n128k16 a stage of 64 values, 64 f32 accumulators a thread). Every thread loads and
// decodes (the decode's ALU work is the other bound: no idle producer warps), as pg_tile. The
// bf16 activations go to shared memory by cp.async (no registers held across the stage: with
// the 64 accumulators, pg_tile's staging registers spilled in the loop).
//
// Shared memory: two stages of A (128 rows) and B (128 weight rows), each row 64 bf16 = 128
// bytes, in wgmma's K-major 128-byte-swizzle layout: 8-row atoms of 1024 bytes (1024-aligned,
// so the descriptors' base offset is 0), row r of an atom at 128·r, its 16-byte chunk c at
// chunk c ^ r (address bits 4–6 ^= bits 7–9). A thread's 16-byte store of chunk c of row r goes
// to 128·r + 16·(c ^ (r & 7)): the 8 threads of a row cover the 8 chunk slots, conflict-free.
// tools/sass/wgmma_swizzle.py checks this against the descriptor's address function.
#define PGW_STAGE (128 * 128)  // bytes a stage of A or B: 128 rows × 128 bytes

// Matrix descriptor of a K-major operand at shared address `a` (1024-aligned atoms, 128-byte
// swizzle): start >> 4 in bits 0–13; leading byte offset (unused by swizzled K-major: 1) in
// 16–29; stride byte offset 1024 (the next 8 rows) >> 4 in 32–45; base offset 0 (49–51);
// swizzle mode 1 = 128B in 62–63. A k16 step advances the start by 32 bytes inside the atom:
// the hardware swizzles the computed address, as it does the threads' stores.
__device__ __forceinline__ unsigned long long wg_desc(unsigned a) {
    return (unsigned long long)((a & 0x3FFFFu) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
           (1ull << 62);
}

// Keeps the compiler from moving accumulator registers across the asynchronous mma (a copy
// between wgmma and its wait would read registers the tensor core is still writing).
__device__ __forceinline__ void wg_fence_acc(float* d) {
#pragma unroll
    for (int i = 0; i < 64; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// d += A · Bᵀ for one k16 step: A 64 × 16 (descriptor da), B 128 × 16 (db), both K-major.
__device__ __forceinline__ void wgmma_m64n128k16(float* d, unsigned long long da, unsigned long long db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
        "%64, %65, p, 1, 1, 0, 0;\n}"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(1));
}

// One 128 × PG_BN tile over k values on wgmma: pg_tile's contract (xrow, wrow, epi; 256
// threads, all calling it), shared memory PGW_SMEM bytes (two stages and 1024 of alignment).
template <int F, bool XB, typename XR, typename WR, typename EPI>
__device__ __forceinline__ void pg_tile_w(int k, XR xrow, WR wrow, EPI epi) {
    static_assert(PG_BK == 64 && PG_BN == 128, "a stage's row is one 128-byte swizzle row");
    static_assert(XB, "bf16 activations (copied as they are)");
    constexpr int BM = 128;
    constexpr int CPR = PG_BK / 8, RP = 256 / CPR, XS = BM / RP, WS = PG_BN / RP;
    extern __shared__ __align__(16) u16 pg_sm[];
    unsigned raw = (unsigned)__cvta_generic_to_shared(pg_sm);
    unsigned base = (raw + 1023u) & ~1023u;  // As[2] then Bs[2], PGW_STAGE bytes each
    char* smb = (char*)pg_sm + (base - raw);
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2;
    int lr = tid / CPR, lc = (tid % CPR) * 8;
    // This thread's swizzled byte offset in a stage (rows lr + RP·i share it: RP is a multiple of 8).
    unsigned so = lr * 128 + (((tid % CPR) ^ (lr & 7)) << 4);
    // The rows' activation addresses in a shared table (read each stage: 8 registers fewer than
    // holding them, which removed the loop's spills); rows past the live ones: a zero fill
    // (source size 0) from row 0's address (always live).
    __shared__ const u16* xp[BM];
    unsigned xn = 0;  // bit i: row lr + RP·i live
#pragma unroll
    for (int i = 0; i < XS; i++) xn |= (xrow(lr + RP * i) ? 1u : 0u) << i;
    if (tid < BM) {
        const u16* p = (const u16*)xrow(tid);
        xp[tid] = p ? p : (const u16*)xrow(0);
    }
    __syncthreads();
    const u8 *wr[WS], *sr[WS];
#pragma unroll
    for (int i = 0; i < WS; i++) wrow(lr + RP * i, wr[i], sr[i]);
    Raw8 ra[WS];
    // The activations of values k0.. straight into stage buf (cp.async, 16 bytes a row chunk), and
    // the weight words into registers.
    auto load = [&](int buf, int k0) {
        unsigned a = base + buf * PGW_STAGE + so;
#pragma unroll
        for (int i = 0; i < XS; i++)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(a + RP * 128 * i),
                         "l"(xp[lr + RP * i] + k0 + lc), "r"((xn >> i & 1u) * 16u)
                         : "memory");
        asm volatile("cp.async.commit_group;" ::: "memory");
#pragma unroll
        for (int i = 0; i < WS; i++) ra[i] = raw8<F>(wr[i], sr[i], k0 + lc);
    };
    // The weight of values k0.. decoded into stage buf; then the stage's activations waited for.
    auto store = [&](int buf, int k0) {
        float y[8];
        char* b = smb + (2 + buf) * PGW_STAGE + so;
#pragma unroll
        for (int i = 0; i < WS; i++) {
            deq8r<F>(ra[i], k0 + lc, y);
            *(uint4*)(b + RP * 128 * i) =
                make_uint4(bf2(y[0], y[1]), bf2(y[2], y[3]), bf2(y[4], y[5]), bf2(y[6], y[7]));
        }
        asm volatile("cp.async.wait_all;" ::: "memory");
        // This thread's generic-proxy writes (the stores above and its cp.async copies, complete
        // now), visible to wgmma's async-proxy reads after the barrier that follows.
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    };
    // Descriptors of stage 0, k 0: this warpgroup's 64 rows of A (8 atoms from row 64·wg), all
    // of B. Stage s and step kk add (s·PGW_STAGE + 32·kk) >> 4 to the start field (no carry out
    // of its 14 bits: shared addresses stay below 2^18).
    unsigned long long da = wg_desc(base + wg * 64 * 128), db = wg_desc(base + 2 * PGW_STAGE);
    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; i++) acc[i] = 0.f;
    load(0, 0);
    store(0, 0);
    __syncthreads();
    int nk = k / PG_BK;
#pragma unroll 1
    for (int kt = 0; kt < nk; kt++) {
        int buf = kt & 1;
        if (kt + 1 < nk) load(buf ^ 1, (kt + 1) * PG_BK);
        wg_fence_acc(acc);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int kk = 0; kk < PG_BK / 16; kk++) {
            unsigned long long o = (unsigned long long)((buf * PGW_STAGE + 32 * kk) >> 4);
            wgmma_m64n128k16(acc, da + o, db + o);
        }
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        // The next stage's copies, decode and stores (the other buffer: its last readers, the
        // previous stage's wgmma, were waited for before the last barrier) overlap this mma.
        if (kt + 1 < nk) store(buf ^ 1, (kt + 1) * PG_BK);
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        wg_fence_acc(acc);
        __syncthreads();
    }
    // Accumulator layout (PTX ISA, wgmma .m64nNk16 D fragment, f32; CUTLASS CLayout_64xN):
    // warp w = warp % 4 of the warpgroup holds rows 16w..16w+15; lane = 4g + t; register
    // 4j + 2h + e (j < N/8, h, e < 2) is row 16w + g + 8h, column 8j + 2t + e. So registers
    // 4j, 4j+1 are columns n, n+1 (n = 8j + 2t) of row r and 4j+2, 4j+3 the same columns of
    // row r + 8: the quads hold 4 consecutive column pairs of a row, as mma.sync's fragments do
    // (pgemm_up's quad shuffles rely on it).
    int r = 64 * wg + 16 * (warp & 3) + (lane >> 2), t = lane & 3;
#pragma unroll
    for (int j = 0; j < PG_BN / 8; j++) {
        int n = 8 * j + 2 * t;
        epi(r, n, acc[4 * j], acc[4 * j + 1]);
        epi(r + 8, n, acc[4 * j + 2], acc[4 * j + 3]);
    }
}

// pg_tile or, for W (BM = 128 only), pg_tile_w.
template <int F, bool XB, int BM, bool W, typename XR, typename WR, typename EPI>
__device__ __forceinline__ void pg_tiles(int k, XR xrow, WR wrow, EPI epi) {
    if constexpr (W) {
        static_assert(BM == 128, "the wgmma tile is 128 rows");
        pg_tile_w<F, XB>(k, xrow, wrow, epi);
    } else {
        pg_tile<F, XB, BM>(k, xrow, wrow, epi);
    }
}

// out[r, o] = x[r, :] · w[o, :] for n rows (x f32, row stride ldx; the grouped projection: the
// output's group o / rpg reads values (o / rpg)·k..). Grid (row tiles, output tiles, splits);
// rpg a multiple of PG_BN when rpg < m, m even. Split z (of gridDim.z > 1) sums values
// z·ks..(z + 1)·ks (ks a multiple of PG_BK) into part[z, n, m], which pg_sum_splits adds in
// split order: a small decode batch's product of few outputs (8 tiles of a 1,024-output
// product) then fills the GPU, and each output's sum is the same whatever the rows (the split
// depends on the shape only).
template <int F, int BM>
__device__ void pgemm_dense(float* __restrict__ out, float* __restrict__ part, const float* __restrict__ x,
                            const u8* __restrict__ w, const u8* __restrict__ s, int n, int k, int m, int ldx,
                            int rpg, int ks) {
    int r0 = blockIdx.x * BM, o0 = blockIdx.y * PG_BN;
    long long xoff = (long long)(o0 / rpg) * k;
    float* dst = gridDim.z == 1 ? out : part + (long long)blockIdx.z * n * m;
    int kb = blockIdx.z * ks, ke = min(k, kb + ks);
    pg_tile_range<F, false, BM>(
        kb, ke, [&](int r) -> const void* { return r0 + r < n ? x + (long long)(r0 + r) * ldx + xoff : nullptr; },
        [&](int nn, const u8*& wr, const u8*& sr) {
            int o = min(o0 + nn, m - 1);
            wr = w + (long long)o * row_bytes(F, k);
            sr = scale_row(F, s, o, k);
        },
        [&](int r, int nn, float v0, float v1) {
            if (r0 + r < n && o0 + nn < m) *(float2*)(dst + (long long)(r0 + r) * m + o0 + nn) = make_float2(v0, v1);
        });
}

// out[i] = part[0, i] + part[1, i] + … (splits of pgemm_dense, added in split order).
extern "C" __global__ void pg_sum_splits(float* __restrict__ out, const float* __restrict__ part, int splits,
                                         long long count) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    float a = part[i];
    for (int z = 1; z < splits; z++) a += part[(long long)z * count + i];
    out[i] = a;
}

// The (expert, row tile) list of a grouped expert launch: tiles[0] the count, tiles[1 + i] =
// expert << 20 | tile (tiles of bm of the expert's pairs off[e]..off[e + 1]). One block.
extern "C" __global__ void moe_tiles(unsigned* tiles, const unsigned* off, int nexp, int bm) {
    __shared__ unsigned cnt[1025];
    pdl_enter();
    for (int e = threadIdx.x; e < nexp; e += blockDim.x) cnt[e + 1] = (off[e + 1] - off[e] + bm - 1) / bm;
    __syncthreads();
    if (threadIdx.x == 0) {
        cnt[0] = 0;
        for (int e = 0; e < nexp; e++) cnt[e + 1] += cnt[e];
        tiles[0] = cnt[nexp];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < nexp; e += blockDim.x)
        for (unsigned j = 0; j < cnt[e + 1] - cnt[e]; j++) tiles[1 + cnt[e] + j] = ((unsigned)e << 20) | j;
}

// This block's expert, its pairs' first index in `order`, and its live rows (0: nothing to do).
struct PgExpert {
    int e, b0, rows;
};

template <int BM>
__device__ __forceinline__ PgExpert pg_expert(const unsigned* tiles, const unsigned* off, const unsigned* order,
                                              unsigned* pid) {
    PgExpert x{0, 0, 0};
    if (blockIdx.x >= tiles[0]) return x;
    unsigned tv = tiles[1 + blockIdx.x];
    x.e = (int)(tv >> 20);
    int r0 = (int)(tv & 0xfffffu) * BM;
    x.b0 = (int)off[x.e] + r0;
    x.rows = min(BM, (int)(off[x.e + 1] - off[x.e]) - r0);
    for (int r = threadIdx.x; r < x.rows; r += blockDim.x) pid[r] = order[x.b0 + r];
    __syncthreads();
    return x;
}

// Routed experts' gate and up products with the clamped SwiGLU: h[p, o] (bf16) for every pair p
// (token p / k, its activations x cast to bf16 once by the launcher) of each tile's expert; grid
// (most tiles, inter / 64), inter a multiple of 64 (a quad's 4 outputs are stored together).
// Weight rows of a block interleave w1 and w3 (column 2i: gate of output o0 + i, 2i + 1: its
// up), so a thread holds both halves of its outputs.
template <int F, int BM, bool W = false>
__device__ void pgemm_up(u16* __restrict__ h, const u16* __restrict__ x, const unsigned* order, const unsigned* off,
                         const unsigned* tiles, const unsigned long long* ptrs, int nexp, int k, int d, int inter,
                         float limit) {
    __shared__ unsigned pid[BM];
    PgExpert ex = pg_expert<BM>(tiles, off, order, pid);
    if (ex.rows == 0) return;  // uniform in the block
    int o0 = blockIdx.y * (PG_BN / 2);
    const u8 *w1 = (const u8*)ptrs[ex.e], *w3 = (const u8*)ptrs[nexp + ex.e];
    const u8 *s1 = (const u8*)ptrs[3 * nexp + ex.e], *s3 = (const u8*)ptrs[4 * nexp + ex.e];
    pg_tiles<F, true, BM, W>(
        d, [&](int r) -> const void* { return r < ex.rows ? x + (long long)(pid[r] / k) * d : nullptr; },
        [&](int nn, const u8*& wr, const u8*& sr) {
            // Selects, not an array indexed by nn & 1 (that put the pointers in local memory).
            int o = min(o0 + (nn >> 1), inter - 1);
            wr = ((nn & 1) ? w3 : w1) + (long long)o * row_bytes(F, d);
            sr = scale_row(F, (nn & 1) ? s3 : s1, o, d);
        },
        [&](int r, int nn, float gate, float up) {
            // The quad's 4 lanes hold 4 consecutive outputs of row r (nn = 8j + 2·lane % 4): lane
            // 0 of the quad stores all 4 (8 bytes) where each lane stored 2 bytes (ncu: 8 of 32
            // bytes a sector used). Every lane of the warp takes part in the shuffles.
            unsigned v = f2bf_q(swiglu_q(gate, up, limit));
            v |= __shfl_down_sync(0xffffffffu, v, 1) << 16;
            unsigned v2 = __shfl_down_sync(0xffffffffu, v, 2);
            int o = o0 + (nn >> 1);
            if ((threadIdx.x & 3) == 0 && r < ex.rows && o < inter)
                *(uint2*)(h + (long long)pid[r] * inter + o) = make_uint2(v, v2);
        });
}

// Routed experts' down products: y[p, o] (f32) from h (bf16); grid (most tiles, d / PG_BN).
template <int F, int BM, bool W = false>
__device__ void pgemm_down(float* __restrict__ y, const u16* __restrict__ h, const unsigned* order,
                           const unsigned* off, const unsigned* tiles, const unsigned long long* ptrs, int nexp, int d,
                           int inter) {
    __shared__ unsigned pid[BM];
    PgExpert ex = pg_expert<BM>(tiles, off, order, pid);
    if (ex.rows == 0) return;  // uniform in the block
    int o0 = blockIdx.y * PG_BN;
    const u8* w = (const u8*)ptrs[2 * nexp + ex.e];
    const u8* s = (const u8*)ptrs[5 * nexp + ex.e];
    pg_tiles<F, true, BM, W>(
        inter, [&](int r) -> const void* { return r < ex.rows ? h + (long long)pid[r] * inter : nullptr; },
        [&](int nn, const u8*& wr, const u8*& sr) {
            int o = min(o0 + nn, d - 1);
            wr = w + (long long)o * row_bytes(F, inter);
            sr = scale_row(F, s, o, inter);
        },
        [&](int r, int nn, float v0, float v1) {
            if (r < ex.rows && o0 + nn < d) *(float2*)(y + (long long)pid[r] * d + o0 + nn) = make_float2(v0, v1);
        });
}

// pgemm_F: dense, 128-row tiles; pgemm_{up,down}{64,128}_F: routed experts in tiles of 64 or 128
// of an expert's pairs (the launcher picks by the pairs an active expert holds on average);
// pgemm_{up,down}128w_F: the 128-row ones on wgmma (W).
#define PGEMM_EXPERTS(F, N, BM, SUF, W)                                                                         \
    extern "C" __global__ void __launch_bounds__(256, PG_MINB)                                                   \
        pgemm_up##BM##SUF##_##N(u16* h, const u16* x, const unsigned* order, const unsigned* off,              \
                                const unsigned* tiles, const unsigned long long* ptrs, int nexp, int k, int d,  \
                                int inter, float limit) {                                                       \
        pdl_enter();                                                                                            \
        fill_tabs<F, false>();                                                                                  \
        pgemm_up<F, BM, W>(h, x, order, off, tiles, ptrs, nexp, k, d, inter, limit);                            \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(256, PG_MINB)                                                   \
        pgemm_down##BM##SUF##_##N(float* y, const u16* h, const unsigned* order, const unsigned* off,          \
                                  const unsigned* tiles, const unsigned long long* ptrs, int nexp, int d,        \
                                  int inter) {                                                                  \
        pdl_enter();                                                                                            \
        fill_tabs<F, false>();                                                                                  \
        pgemm_down<F, BM, W>(y, h, order, off, tiles, ptrs, nexp, d, inter);                                    \
    }

#define PGEMM_DENSE(F, N, BM, SUF)                                                                              \
    extern "C" __global__ void __launch_bounds__(256) pgemm##SUF##_##N(float* out, float* part, const float* x,  \
                                                                       const u8* w, const u8* s, int n, int k, \
                                                                       int m, int ldx, int rpg, int ks) {      \
        pdl_enter();                                                                                            \
        fill_tabs<F, false>();                                                                                  \
        pgemm_dense<F, BM>(out, part, x, w, s, n, k, m, ldx, rpg, ks);                                          \
    }

// pgemm_F / pgemm64_F: dense products in tiles of 128 / 64 rows.
#define PGEMM_KERNELS(F, N)                                                                                     \
    PGEMM_DENSE(F, N, 128, )                                                                                    \
    PGEMM_DENSE(F, N, 64, 64)                                                                                   \
    PGEMM_EXPERTS(F, N, 64, , false)                                                                            \
    PGEMM_EXPERTS(F, N, 128, , false)                                                                           \
    PGEMM_EXPERTS(F, N, 128, w, true)

PGEMM_KERNELS(F_Q8_0, q8_0)
PGEMM_KERNELS(F_Q4_K, q4_k)
PGEMM_KERNELS(F_Q2_K, q2_k)
PGEMM_KERNELS(F_IQ2_XXS, iq2_xxs)
PGEMM_KERNELS(F_FP8, fp8)
PGEMM_KERNELS(F_FP4, fp4)
PGEMM_KERNELS(F_BF16, bf16w)
