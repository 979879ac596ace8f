// bf16 weights: the small-batch product (f32 activations × bf16 weights, f32 accumulation), the
// large-batch expert helpers, casts, the nonfinite probe and on-device random init. (The grouped
// routed-expert kernels are quant.cu's, bf16 being one of its formats.)
// Launchers: cuda/bf16.rs. Compiled with FMA contraction on (unlike the other files).
//
// bf16 values are carried as `unsigned short` (no cuda_bf16.h under NVRTC): the f32 value is
// the 16 bits shifted up.

#define GV_ROWS 8

__device__ __forceinline__ float bf2f(unsigned short h) { return __uint_as_float(((unsigned)h) << 16); }

__device__ __forceinline__ unsigned short f2bf(float f) {
    unsigned b = __float_as_uint(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((b >> 16) | 0x40u);
    b += 0x7fffu + ((b >> 16) & 1u);
    return (unsigned short)(b >> 16);
}

__device__ __forceinline__ void unpack8(uint4 v, float* f) {
    f[0] = __uint_as_float(v.x << 16); f[1] = __uint_as_float(v.x & 0xffff0000u);
    f[2] = __uint_as_float(v.y << 16); f[3] = __uint_as_float(v.y & 0xffff0000u);
    f[4] = __uint_as_float(v.z << 16); f[5] = __uint_as_float(v.z & 0xffff0000u);
    f[6] = __uint_as_float(v.w << 16); f[7] = __uint_as_float(v.w & 0xffff0000u);
}

__device__ __forceinline__ uint4 ldg_stream(const unsigned short* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// One 8-value chunk's products in a fixed order (every bf16 product kernel's chunk sum).
__device__ __forceinline__ float dot8v(const float* w, float4 a, float4 b) {
    float s = w[0] * a.x;
    s += w[1] * a.y; s += w[2] * a.z; s += w[3] * a.w;
    s += w[4] * b.x; s += w[5] * b.y; s += w[6] * b.z; s += w[7] * b.w;
    return s;
}

__device__ __forceinline__ float dot8(const float* w, const float* __restrict__ x) {
    return dot8v(w, *(const float4*)x, *(const float4*)(x + 4));
}

// acc[j] += w_row · x_row(j) for the `nr` rows given by `xrow[j]` (each `k` wide, 16-byte
// aligned when vec). One warp; lane-strided 8-element chunks.
template <int R>
__device__ __forceinline__ void warp_rows_dot_r(float* acc, const unsigned short* __restrict__ wr,
                                                const float* const* xrow, int nr, int k, bool vec, int lane) {
    if (vec) {
#pragma unroll 2
        for (int c = lane * 8; c < k; c += 256) {
            float wf[8];
            unpack8(ldg_stream(wr + c), wf);
#pragma unroll
            for (int j = 0; j < R; j++)
                if (j < nr) acc[j] += dot8(wf, xrow[j] + c);
        }
    } else {
        for (int c = lane; c < k; c += 32) {
            float wf = bf2f(wr[c]);
#pragma unroll
            for (int j = 0; j < R; j++)
                if (j < nr) acc[j] += wf * xrow[j][c];
        }
    }
}

// The products of one input x with up to BFG_MAX bf16 weights of the same k, in one launch:
// entry e (weight w[e] [m[e], k], output out[e] [n, m[e]], rows per x group rpg[e]) takes blocks
// b0[e]..b0[e + 1] of the grid's x. A single product is a one-entry table. The compressor's and
// indexer's projections of one attention input are 2–5 products of 64–1,024 outputs: alone each
// launch ran 4–64 blocks and its own ~8 µs chain at one row (PERF.md v17).
#define BFG_MAX 8
struct BfGroup {
    const unsigned short* w[BFG_MAX];
    float* out[BFG_MAX];
    int m[BFG_MAX];
    int rpg[BFG_MAX];
    int b0[BFG_MAX + 1];
    int count;
};

// The entry holding block bx, and bx made relative to the entry's first block.
__device__ __forceinline__ int bfg_entry(const BfGroup& g, int* bx) {
    int e = 0;
#pragma unroll
    for (int i = 1; i < BFG_MAX; i++)
        if (i < g.count && *bx >= g.b0[i]) e = i;
    *bx -= g.b0[e];
    return e;
}

// out[r, o] = x[r, (o / rpg)·k .. +k] · w[o, :] for r < n, o < m; x rows are ldx apart (a plain
// product has rpg = m). One warp per output column o (block bx of the product), rows in groups
// of R (8; 1 for a single row: fewer registers, more warps resident), the grid's y taking every
// gridDim.y-th group: a row's sum has one order whatever warp forms it, so the split changes no
// value (exact mode at 64 rows ran one warp an output through 8 groups in turn: 1.25 ms of a
// 12.8 ms 4-layer step, PERF.md v36).
template <int R>
__device__ void gemv_bf16_r(float* __restrict__ out, const float* __restrict__ x,
                            const unsigned short* __restrict__ w, int n, int k, int m, int ldx, int rpg, int bx) {
    int o = (int)((bx * (long long)blockDim.x + threadIdx.x) >> 5), lane = threadIdx.x & 31;
    if (o >= m) return;
    const unsigned short* wr = w + (long long)o * k;
    long long xoff = (long long)(o / rpg) * k;
    bool vec = (k & 7) == 0 && (ldx & 3) == 0 && (xoff & 3) == 0;
    for (int r0 = R * blockIdx.y; r0 < n; r0 += R * gridDim.y) {
        int nr = min(R, n - r0);
        float acc[R];
        const float* xrow[R];
#pragma unroll
        for (int j = 0; j < R; j++) {
            acc[j] = 0.f;
            xrow[j] = x + (long long)(r0 + min(j, nr - 1)) * ldx + xoff;
        }
        warp_rows_dot_r<R>(acc, wr, xrow, nr, k, vec, lane);
#pragma unroll
        for (int j = 0; j < R; j++) {
            float v = warp_sum(acc[j]);
            if (j < nr && lane == 0) out[(long long)(r0 + j) * m + o] = v;
        }
    }
}

extern "C" __global__ void gemv_bf16(BfGroup g, const float* x, int n, int k, int ldx) {
    pdl_enter();
    int bx = blockIdx.x, e = bfg_entry(g, &bx);
    gemv_bf16_r<GV_ROWS>(g.out[e], x, g.w[e], n, k, g.m[e], ldx, g.rpg[e], bx);
}

extern "C" __global__ void gemv1_bf16(BfGroup g, const float* x, int n, int k, int ldx) {
    pdl_enter();
    int bx = blockIdx.x, e = bfg_entry(g, &bx);
    gemv_bf16_r<1>(g.out[e], x, g.w[e], n, k, g.m[e], ldx, g.rpg[e], bx);
}

// Fast-mode bf16 products of 1 to 16 rows on tensor cores (mma.m16n8k16, bf16 operands, f32
// accumulation): activations rounded to bf16 (the fast path's stated approximation, as for the
// cuBLAS products above GEMV_ROWS), and a fixed summation order whatever the row count, so a
// row's result does not depend on its batch:
// - block (16 outputs, 16 rows), 8 warps; warp w takes the k32 blocks w, w + 8, w + 16, ... in
//   increasing order, two mma each (lane (g, t) holds values 8t..8t+7 of a block: one 16-byte
//   weight load per output row and 32 bytes of its row's activations; the mma's k order is a
//   fixed permutation of the block's, the same for weights and activations);
// - the 8 warps' partial sums added in warp order through shared memory.
// A row only ever occupies its own mma column, and each output element is formed from its own
// weight row, activation column and accumulator. Needs k a multiple of 32 and the 16 outputs of
// a tile in one group (rpg a multiple of 16, or one group); the launcher checks.
// (a, b) rounded to bf16 (nearest even, as f2bf) and packed: a in the low half.
__device__ __forceinline__ unsigned bf2_pack(float a, float b) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    return r;
}

__device__ __forceinline__ void mma_bf16(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                         unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// U: k32 blocks whose weight loads a warp issues before any of their mma. The blocks' order is
// the same for every U, so the instances below give the same bits and the launcher picks by
// row count (H200, 4 q2 layers: U = 4 is 0.04 ms a step faster at batch 1, where the block
// count is m / 16 and each warp's bytes in flight set the rate; U = 1 is 0.2 ms faster at
// batch 16, with fewer registers). PIPE: two buffers of U blocks, the next U's loads issued
// before the current U's mma (gemvtp_bf16): without, a warp's k loop waits a memory round trip
// every U blocks with nothing in flight, and a decode product of m / 16 = 32–128 blocks (about
// one an SM) held 32 KB an SM in flight, 1.7 TB/s (ncu, PERF.md v25).
template <int U, bool PIPE = false>
__device__ __forceinline__ void gemvt_body(float* out, const float* x, const unsigned short* w, int n, int k, int m,
                                           int ldx, int rpg, int bx) {
    __shared__ float part[8][16][17];  // [warp][output][row] (+1: no bank conflicts on the merge)
    int wp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int o0 = bx * 16, r0 = blockIdx.y * 16;
    int nr = min(16, n - r0);
    const unsigned short* wa = w + (long long)min(o0 + g, m - 1) * k + 8 * t;  // outputs past m: not stored
    const unsigned short* wb = w + (long long)min(o0 + g + 8, m - 1) * k + 8 * t;
    long long xoff = (long long)(o0 / rpg) * k + 8 * t;
    const float* xa = x + (long long)(r0 + min(g, nr - 1)) * ldx + xoff;  // rows past n: not stored
    const float* xb = x + (long long)(r0 + min(g + 8, nr - 1)) * ldx + xoff;
    bool two = nr > 8;
    float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
    uint4 A[U], B[U], A2[PIPE ? U : 1], B2[PIPE ? U : 1];
    auto load = [&](uint4* a, uint4* b, int kb0) {
#pragma unroll
        for (int u = 0; u < U; u++)
            if (kb0 + 256 * u < k) a[u] = ldg_stream(wa + kb0 + 256 * u), b[u] = ldg_stream(wb + kb0 + 256 * u);
    };
    auto math = [&](const uint4* a, const uint4* b, int kb0) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            int kb = kb0 + 256 * u;
            if (kb >= k) break;
            float4 p = *(const float4*)(xa + kb), q = *(const float4*)(xa + kb + 4);
            mma_bf16(d0, a[u].x, b[u].x, a[u].y, b[u].y, bf2_pack(p.x, p.y), bf2_pack(p.z, p.w));
            mma_bf16(d0, a[u].z, b[u].z, a[u].w, b[u].w, bf2_pack(q.x, q.y), bf2_pack(q.z, q.w));
            if (two) {
                float4 u4 = *(const float4*)(xb + kb), v = *(const float4*)(xb + kb + 4);
                mma_bf16(d1, a[u].x, b[u].x, a[u].y, b[u].y, bf2_pack(u4.x, u4.y), bf2_pack(u4.z, u4.w));
                mma_bf16(d1, a[u].z, b[u].z, a[u].w, b[u].w, bf2_pack(v.x, v.y), bf2_pack(v.z, v.w));
            }
        }
    };
    // Weights never change during a forward (the weight draws synchronise after writing them),
    // so the first loads are issued before PDL's wait: they fly while the previous kernel ends
    // (pdl_enter_after).
    load(A, B, 32 * wp);
    unsigned dep = 0;
#pragma unroll
    for (int u = 0; u < U; u++)
        if (32 * wp + 256 * u < k) dep ^= A[u].x ^ B[u].x;
    pdl_enter_after(dep);
    if constexpr (PIPE) {
        for (int kb0 = 32 * wp; kb0 < k; kb0 += 512 * U) {  // A, B hold kb0's blocks
            int kb1 = kb0 + 256 * U;
            if (kb1 < k) load(A2, B2, kb1);
            math(A, B, kb0);
            if (kb1 >= k) break;
            if (kb1 + 256 * U < k) load(A, B, kb1 + 256 * U);
            math(A2, B2, kb1);
        }
    } else {
        for (int kb0 = 32 * wp; kb0 < k; kb0 += 256 * U) {
            if (kb0 != 32 * wp) load(A, B, kb0);
            math(A, B, kb0);
        }
    }
    mma_tile_part(part[wp], d0, d1, g, t);
    __syncthreads();
    int oo = threadIdx.x >> 4, rr = threadIdx.x & 15;
    if (o0 + oo >= m || rr >= nr) return;
    float v = part[0][oo][rr];
#pragma unroll
    for (int i = 1; i < 8; i++) v += part[i][oo][rr];
    out[(long long)(r0 + rr) * m + o0 + oo] = v;
}

// (gemvt_body waits for the previous kernel itself, after its first weight loads.)
extern "C" __global__ void __launch_bounds__(256) gemvt_bf16(BfGroup g, const float* x, int n, int k, int ldx) {
    int bx = blockIdx.x, e = bfg_entry(g, &bx);
    gemvt_body<4>(g.out[e], x, g.w[e], n, k, g.m[e], ldx, g.rpg[e], bx);
}

extern "C" __global__ void __launch_bounds__(256) gemvt16_bf16(BfGroup g, const float* x, int n, int k, int ldx) {
    int bx = blockIdx.x, e = bfg_entry(g, &bx);
    gemvt_body<1>(g.out[e], x, g.w[e], n, k, g.m[e], ldx, g.rpg[e], bx);
}

// gemvt_bf16's bits with the next 4 blocks' loads in flight during the current 4's mma.
extern "C" __global__ void __launch_bounds__(256) gemvtp_bf16(BfGroup g, const float* x, int n, int k, int ldx) {
    int bx = blockIdx.x, e = bfg_entry(g, &bx);
    gemvt_body<4, true>(g.out[e], x, g.w[e], n, k, g.m[e], ldx, g.rpg[e], bx);
}

// Eight values a thread (two 16-byte loads, one 16-byte store: the scalar version moved 0.7 TB/s,
// 9 % of an 8K prefill chunk's time), the last len % 8 one by one. x and out 16-byte aligned.
extern "C" __global__ void cast_bf16(unsigned short* out, const float* x, long long len) {
    pdl_enter();
    long long n8 = len / 8;
    GRID_STRIDE(i, n8) {
        float4 a = ((const float4*)x)[2 * i], b = ((const float4*)x)[2 * i + 1];
        ((uint4*)out)[i] = make_uint4(f2bf(a.x) | (unsigned)f2bf(a.y) << 16, f2bf(a.z) | (unsigned)f2bf(a.w) << 16,
                                      f2bf(b.x) | (unsigned)f2bf(b.y) << 16, f2bf(b.z) | (unsigned)f2bf(b.w) << 16);
    }
    if (blockIdx.x == 0 && threadIdx.x < len - 8 * n8) out[8 * n8 + threadIdx.x] = f2bf(x[8 * n8 + threadIdx.x]);
}

// Groups the n·k (row, slot) pairs by expert (one block): off[e]..off[e+1] of `order` are the
// slots routed to local expert e = id − first; active[0..active[ne]] lists the experts with any
// slot, followed by the slot records (moe_slots). Slots routed outside first..first+ne (other
// ranks' experts) are left out: off[ne] counts the slots held here.
extern "C" __global__ void moe_sort(unsigned* order, unsigned* off, unsigned* active, const unsigned* ids, int nk,
                                    int ne, unsigned first) {
    pdl_enter();
    __shared__ unsigned cnt[1024];
    __shared__ unsigned pos[1024];
    for (int e = threadIdx.x; e < ne; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int s = threadIdx.x; s < nk; s += blockDim.x) {
        unsigned e = ids[s] - first;
        if (e < (unsigned)ne) atomicAdd(&cnt[e], 1u);
    }
    __syncthreads();
    if (ne > 0 && ne <= (int)blockDim.x) {
        // Offsets and the active list by a block-wide exclusive scan of (count, count > 0): one
        // expert a thread (a serial loop over 256 experts in thread 0 took ~5 µs of the ~9).
        __shared__ unsigned wc[32], wa[32];
        int e = threadIdx.x, lane = e & 31, wp = e >> 5;
        unsigned c = e < ne ? cnt[e] : 0u, a = c ? 1u : 0u, ic = c, ia = a;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            unsigned tc = __shfl_up_sync(0xffffffffu, ic, o), ta = __shfl_up_sync(0xffffffffu, ia, o);
            if (lane >= o) ic += tc, ia += ta;
        }
        if (lane == 31) wc[wp] = ic, wa[wp] = ia;
        __syncthreads();
        if (wp == 0) {
            int nw = (blockDim.x + 31) >> 5;
            unsigned vc = lane < nw ? wc[lane] : 0u, va = lane < nw ? wa[lane] : 0u;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                unsigned tc = __shfl_up_sync(0xffffffffu, vc, o), ta = __shfl_up_sync(0xffffffffu, va, o);
                if (lane >= o) vc += tc, va += ta;
            }
            if (lane < nw) wc[lane] = vc - (lane < nw ? wc[lane] : 0u), wa[lane] = va - wa[lane];
        }
        __syncthreads();
        unsigned xc = wc[wp] + ic - c, xa = wa[wp] + ia - a;  // exclusive prefixes
        __shared__ unsigned nact;
        if (e < ne) {
            off[e] = xc;
            pos[e] = xc;
            if (c) active[xa] = (unsigned)e;
            if (e == ne - 1) off[ne] = xc + c, active[ne] = nact = xa + a;
        }
        __syncthreads();
        if (e < ne) {
            uint4* rec = moe_slots(active, ne);
            if (c) rec[xa] = make_uint4((unsigned)e, xc, c, nact);
            if ((unsigned)e >= nact) rec[e] = make_uint4(0u, 0u, 0u, 0u);
        }
    } else if (threadIdx.x == 0) {
        unsigned acc = 0, na = 0;
        for (int e = 0; e < ne; e++) {
            off[e] = acc;
            pos[e] = acc;
            if (cnt[e]) active[na++] = (unsigned)e;
            acc += cnt[e];
        }
        off[ne] = acc;
        active[ne] = na;
        uint4* rec = moe_slots(active, ne);
        for (unsigned a = 0; a < (unsigned)ne; a++) {
            unsigned e = a < na ? active[a] : 0u;
            rec[a] = a < na ? make_uint4(e, off[e], cnt[e], na) : make_uint4(0u, 0u, 0u, 0u);
        }
    }
    __syncthreads();
    for (int s = threadIdx.x; s < nk; s += blockDim.x) {
        unsigned e = ids[s] - first;
        if (e < (unsigned)ne) {
            unsigned p = atomicAdd(&pos[e], 1u);
            order[p] = (unsigned)s;
        }
    }
}

__device__ __forceinline__ float swiglu1(float g, float u, float limit) {
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
    return g * sigmoid_(g) * u;
}

// xs[p, :] = bf16(x[order[p] / k, :]); inv[order[p]] = p (the large-batch expert path).
extern "C" __global__ void moe_gather_bf16(unsigned short* xs, unsigned* inv, const float* x, const unsigned* order,
                                           int nk, int k, int d) {
    pdl_enter();
    GRID_STRIDE(e, (long long)nk * d) {
        long long p = e / d, c = e % d;
        unsigned s = order[p];
        xs[e] = f2bf(x[(long long)(s / k) * d + c]);
        if (c == 0) inv[s] = (unsigned)p;
    }
}

// hb = bf16(act(g, u)) elementwise.
extern "C" __global__ void swiglu_bf16(unsigned short* hb, const float* g, const float* u, long long len, float limit) {
    pdl_enter();
    GRID_STRIDE(e, len) hb[e] = f2bf(swiglu1(g[e], u[e], limit));
}

// out[r, c] = Σ_j wts[r, j]·y[inv[r·k + j], c], in routing order; slots whose inv is 0xffffffff
// (routed to another rank's experts) add nothing.
extern "C" __global__ void moe_combine_sorted(float* out, const float* y, const unsigned* inv, const float* wts, int n,
                                              int k, int d) {
    pdl_enter();
    GRID_STRIDE(e, (long long)n * d) {
        long long r = e / d, c = e % d;
        float acc = 0.f;
        for (int j = 0; j < k; j++) {
            unsigned p = inv[r * k + j];
            if (p != 0xffffffffu) acc += wts[r * k + j] * y[(long long)p * d + c];
        }
        out[e] = acc;
    }
}

// flags[slot] = max(flags[slot], 0xffffffff − first row holding a NaN/±∞) (0: all finite).
// Four values a load, two loads in flight a thread (the scalar version read 0.7 TB/s: 81 probes
// were 12 % of an 8K prefill chunk), the last len % 4 one by one. x 16-byte aligned.
__device__ __forceinline__ void probe_one(unsigned* flag, float v, long long e, int cols) {
    if ((__float_as_uint(v) & 0x7f800000u) == 0x7f800000u) atomicMax(flag, 0xffffffffu - (unsigned)(e / cols));
}
__device__ __forceinline__ void probe_four(unsigned* flag, float4 v, long long e, int cols) {
    unsigned m = 0x7f800000u;
    if ((__float_as_uint(v.x) & m) == m || (__float_as_uint(v.y) & m) == m || (__float_as_uint(v.z) & m) == m ||
        (__float_as_uint(v.w) & m) == m) {
        probe_one(flag, v.x, e, cols);
        probe_one(flag, v.y, e + 1, cols);
        probe_one(flag, v.z, e + 2, cols);
        probe_one(flag, v.w, e + 3, cols);
    }
}
extern "C" __global__ void probe_finite(unsigned* flags, int slot, const float* x, long long len, int cols) {
    pdl_enter();
    long long n4 = len / 4, stride = (long long)gridDim.x * blockDim.x;
    const float4* x4 = (const float4*)x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n4; i += 2 * stride) {
        float4 a = x4[i];
        float4 b = i + stride < n4 ? x4[i + stride] : make_float4(0.f, 0.f, 0.f, 0.f);
        probe_four(flags + slot, a, 4 * i, cols);
        probe_four(flags + slot, b, 4 * (i + stride), cols);
    }
    if (blockIdx.x == 0 && threadIdx.x < len - 4 * n4) probe_one(flags + slot, x[4 * n4 + threadIdx.x], 4 * n4 + threadIdx.x, cols);
}

__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Normal(mean, std) from a counter-based hash (Box–Muller), as bf16 (bf != 0) or f32.
extern "C" __global__ void rand_normal(void* out, int bf, long long len, float mean, float std,
                                       unsigned long long seed) {
    pdl_enter();
    GRID_STRIDE(e, len) {
        unsigned long long a = mix64(seed * 0x9E3779B97F4A7C15ull + 2 * e + 1);
        unsigned long long b = mix64(a ^ 0xD1B54A32D192ED03ull);
        float u1 = ((a >> 40) + 0.5f) * (1.0f / 16777216.0f);
        float u2 = ((b >> 40) + 0.5f) * (1.0f / 16777216.0f);
        float v = mean + std * sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2);
        if (bf) ((unsigned short*)out)[e] = f2bf(v);
        else ((float*)out)[e] = v;
    }
}
