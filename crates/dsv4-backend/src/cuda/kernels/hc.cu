// mHC (spec §4): HC_PRE with Sinkhorn, HC_POST and HC_HEAD. Launchers: cuda/mod.rs.
// The mixing products x·fnᵀ come from cuBLAS (`m`); these kernels apply ρ = 1/rms(x) and the rest.

#define MAX_HC 8

// Sinkhorn normalisation of an n×n matrix after a row softmax, in the oracle's exact order.
// Called by all of warp 0. Each lane owns elements e = lane, lane + 32, ...; for each it forms the
// sum of its row (or column) itself, in the serial loop's order, then divides: every value is the
// serial result, with one division in each pass's critical path instead of n.
__device__ void sinkhorn_warp(float* c, const float* a, int n, int iters, float eps) {
    int lane = threadIdx.x;
    float v[MAX_HC * MAX_HC / 32 + 1];
    int ne = n * n, k = 0;
    for (int e = lane; e < ne; e += 32, k++) {
        int j = e / n, q = e % n;
        float m = -INFINITY;
        for (int t = 0; t < n; t++) m = fmaxf(m, a[j * n + t]);
        float s = 0.f;
        for (int t = 0; t < n; t++) s += expf(a[j * n + t] - m);
        v[k] = expf(a[j * n + q] - m) / s + eps;
    }
    k = 0;
    for (int e = lane; e < ne; e += 32, k++) c[e] = v[k];
    __syncwarp();
    for (int it = 0; it < iters; it++) {
        for (int pass = (it > 0 ? 0 : 1); pass < 2; pass++) {
            k = 0;
            for (int e = lane; e < ne; e += 32, k++) {
                int j = e / n, q = e % n;
                float s = 0.f;
                if (pass == 0)
                    for (int t = 0; t < n; t++) s += c[j * n + t];  // row j
                else
                    for (int r = 0; r < n; r++) s += c[r * n + q];  // column q
                s += eps;
                v[k] = c[e] / s;
            }
            __syncwarp();
            k = 0;
            for (int e = lane; e < ne; e += 32, k++) c[e] = v[k];
            __syncwarp();
        }
    }
}

// The same Sinkhorn for n·n ≤ 32 (V4: 4 × 4) with element e in lane e's register: each pass
// gathers the lane's row (or column) with n independent shuffles and adds them in the serial
// order, so every value is bitwise sinkhorn_warp's (and the oracle's). n is a compile-time
// constant (sinkhorn_small dispatches): with a runtime n every `t < n` guard was a branch, so a
// pass's shuffles, adds and division ran one basic block at a time, and 20 iterations took
// ~11 µs of hc_pre_apply's 17 (timed with iters = 1, PERF.md v10). The shared-memory version
// waits on dependent shared loads and two warp barriers a pass.
template <int N>
__device__ void sinkhorn_regn(float* c, const float* a, int iters, float eps) {
    int lane = threadIdx.x & 31;
    constexpr int NE = N * N;
    bool on = lane < NE;
    int j = on ? lane / N : 0, q = on ? lane % N : 0;
    // Lanes past n·n divide a dummy 1 (never stored). A 0 there sent the whole warp through the
    // division's slow path (FCHK flags a zero dividend) in every pass: ncu's instruction counts
    // showed its subroutine run 39 times a call, and 20 iterations cost ~5.6 µs of
    // hc_pre_apply_norm's 13.4 at one row (H100; PERF.md v30).
    float v = 1.f;
    if (on) {
        float m = -INFINITY;
#pragma unroll
        for (int t = 0; t < N; t++) m = fmaxf(m, a[j * N + t]);
        float s = 0.f;
#pragma unroll
        for (int t = 0; t < N; t++) s += expf(a[j * N + t] - m);
        v = expf(a[j * N + q] - m) / s + eps;
    }
    for (int it = 0; it < iters; it++) {
#pragma unroll
        for (int pass = 0; pass < 2; pass++) {
            if (it == 0 && pass == 0) continue;  // the first iteration starts with the column pass
            float g[N];
#pragma unroll
            for (int t = 0; t < N; t++) g[t] = __shfl_sync(0xffffffffu, v, pass == 0 ? j * N + t : t * N + q);
            // The serial loop's `0 + g[0]` is g[0]: the values are positive (or NaN), never -0.
            float s = g[0];
#pragma unroll
            for (int t = 1; t < N; t++) s += g[t];
            s += eps;
            v = v / s;
        }
    }
    if (on) c[lane] = v;
}

// sinkhorn_regn for the n (1..5) whose n·n elements fit a warp's lanes.
__device__ void sinkhorn_small(float* c, const float* a, int n, int iters, float eps) {
    switch (n) {
        case 1: sinkhorn_regn<1>(c, a, iters, eps); break;
        case 2: sinkhorn_regn<2>(c, a, iters, eps); break;
        case 3: sinkhorn_regn<3>(c, a, iters, eps); break;
        case 4: sinkhorn_regn<4>(c, a, iters, eps); break;
        default: sinkhorn_regn<5>(c, a, iters, eps); break;
    }
}

// Σ over the thread's strided slice k = t, t + B, ... of f(k), summed in that order, with the
// loads of 8 iterations issued before their adds (a single block would otherwise wait for each
// load in turn).
#define STRIDED_SUM(acc, start, end, step, EXPR)                                      \
    for (int k0_ = (start); k0_ < (end); k0_ += 8 * (step)) {                          \
        float v_[8];                                                                  \
        _Pragma("unroll") for (int j_ = 0; j_ < 8; j_++) {                            \
            int k = k0_ + j_ * (step);                                                \
            v_[j_] = k < (end) ? (EXPR) : 0.f;                                        \
        }                                                                             \
        _Pragma("unroll") for (int j_ = 0; j_ < 8; j_++) if (k0_ + j_ * (step) < (end)) acc += v_[j_]; \
    }

// ρ = 1/sqrt(mean(x²) + eps) over the whole n·d row.
__device__ float hc_rho(const float* xr, int width, float eps, float* sh) {
    float s = 0.f;
    STRIDED_SUM(s, (int)threadIdx.x, width, (int)blockDim.x, xr[k] * xr[k])
    s = block_sum(s, sh);
    return 1.0f / sqrtf(s / (float)width + eps);
}

// y[c] = Σ_s pre_s·X_s[c] for the block's columns, the loads of 4 columns issued together.
__device__ __forceinline__ void hc_mix(float* yr, const float* xr, const float* pre, int n, int d) {
    for (int c0 = threadIdx.x; c0 < d; c0 += 4 * blockDim.x) {
        float xv[4][MAX_HC];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int c = c0 + u * blockDim.x;
#pragma unroll
            for (int s = 0; s < MAX_HC; s++) xv[u][s] = (s < n && c < d) ? xr[s * d + c] : 0.f;
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int c = c0 + u * blockDim.x;
            if (c >= d) continue;
            float acc = 0.f;
#pragma unroll
            for (int s = 0; s < MAX_HC; s++)
                if (s < n) acc += pre[s] * xv[u][s];
            yr[c] = acc;
        }
    }
}

// HC_PRE in two launches whatever the number of rows (a row's sums run in one fixed order, so
// its result does not depend on the batch it shares):
//   hc_pre_dot: block (s, g, rg) forms, for the rows of row group rg, the partial sums over
//     column slice s (HC_SPLIT slices of the n·d row) of outputs 8g..8g+8 of [x·fnᵀ | Σ x²];
//   hc_pre_apply: block (b, i) adds row i's HC_SPLIT partials in slice order, applies ρ, forms
//     pre, and mixes columns 1024b.. of y (an extra last block forms post and the Sinkhorn comb).
// At one row the 1.5 MB fn is read by 32·⌈(mix + 1)/8⌉ blocks at once instead of 24 lone warps
// and one block reading the row twice (PERF.md v6).
#define HC_SPLIT 32
#define HC_ROWS 4  // rows a dot block takes (they share each weight load)

// hc_pre_dot's block; with POST, the row values X are HC_POST's new streams X' = post·f + comb·X
// (of `x`, the old ones), formed here with hc_post_t's operations in its order (every output
// group forms the same values; group 0 stores them into `out`): hc_post_dot, HC_POST and the
// next HC_PRE's sums in one launch, bitwise hc_post then hc_pre_dot.
template <bool POST>
__device__ __forceinline__ void hc_dot_block(float* part, const float* __restrict__ x, const float* __restrict__ fn,
                                             int rows, int mix, int width, float* out, const float* f,
                                             const float* post, const float* comb, int n, int d) {
    __shared__ float red[8][HC_ROWS * 8];
    int s = blockIdx.x, o0 = blockIdx.y * 8, r0 = blockIdx.z * HC_ROWS, t = threadIdx.x;
    int per = (width + HC_SPLIT - 1) / HC_SPLIT, c0 = s * per, c1 = min(width, c0 + per);
    int nr = min(HC_ROWS, rows - r0);
    float acc[HC_ROWS][8];
#pragma unroll
    for (int r = 0; r < HC_ROWS; r++)
#pragma unroll
        for (int o = 0; o < 8; o++) acc[r][o] = 0.f;
    // Two columns' loads (x and the 8 fn rows) issued before any multiply-add: with a `break`
    // between the fn loads each waited for the one before it, 16 DRAM latencies a thread
    // (~9.6 µs a call at one row, PERF.md v10). The sums run in the same order as before.
    constexpr int CU = 2;
    for (int cb = c0 + t; cb < c1; cb += CU * blockDim.x) {
        float xv[CU][HC_ROWS], wv[CU][8];
#pragma unroll
        for (int u = 0; u < CU; u++) {
            int c = cb + u * blockDim.x;
            bool in = c < c1;
            if (POST) {
                int j = in ? c / d : 0, cc = c - j * d;  // stream j, column cc
#pragma unroll
                for (int r = 0; r < HC_ROWS; r++) {
                    float v = 0.f;
                    if (in && r < nr) {
                        long long i = r0 + r;
                        const float* cr = comb + i * n * n;
                        const float* xr = x + i * n * d;
                        v = post[i * n + j] * f[i * d + cc];
#pragma unroll
                        for (int q = 0; q < MAX_HC; q++)
                            if (q < n) v += cr[q * n + j] * xr[(long long)q * d + cc];
                        if (blockIdx.y == 0) out[i * width + c] = v;
                    }
                    xv[u][r] = v;
                }
            } else {
#pragma unroll
                for (int r = 0; r < HC_ROWS; r++) xv[u][r] = (in && r < nr) ? x[(long long)(r0 + r) * width + c] : 0.f;
            }
#pragma unroll
            for (int o = 0; o < 8; o++) wv[u][o] = (in && o0 + o < mix) ? fn[(long long)(o0 + o) * width + c] : 0.f;
        }
#pragma unroll
        for (int u = 0; u < CU; u++) {
            if (cb + u * (int)blockDim.x >= c1) break;
#pragma unroll
            for (int o = 0; o < 8; o++) {
                int oo = o0 + o;
                if (oo > mix) break;
                // Output `mix` is the row's sum of squares (the RMS of the whole n·d row).
#pragma unroll
                for (int r = 0; r < HC_ROWS; r++) acc[r][o] += (oo < mix ? wv[u][o] : xv[u][r]) * xv[u][r];
            }
        }
    }
    int lane = t & 31, wp = t >> 5;
#pragma unroll
    for (int r = 0; r < HC_ROWS; r++) {
        if (r >= nr) break;  // block-uniform: a decode row sums one row's outputs, not four
#pragma unroll
        for (int o = 0; o < 8; o++) {
            float v = warp_sum(acc[r][o]);
            if (lane == 0) red[wp][r * 8 + o] = v;
        }
    }
    __syncthreads();
    if (t < HC_ROWS * 8) {
        int r = t / 8, o = t % 8;
        if (r < nr && o0 + o <= mix) {
            float v = 0.f;
            for (int w = 0; w < (int)(blockDim.x >> 5); w++) v += red[w][t];
            part[((long long)(r0 + r) * HC_SPLIT + s) * (mix + 1) + o0 + o] = v;
        }
    }
}

// The fn rows and columns hc_dot_block's block reads (8 rows of its column slice: threads 0..7),
// asked of L2 before the wait (WEIGHT_HINT).
__device__ __forceinline__ void hc_dot_hint(const float* fn, int mix, int width) {
    int o = blockIdx.y * 8 + threadIdx.x, per = (width + HC_SPLIT - 1) / HC_SPLIT, c0 = blockIdx.x * per;
    if (threadIdx.x < 8 && o < mix && blockIdx.z == 0)
        WEIGHT_HINT(fn + (long long)o * width + c0, 4LL * (min(width, c0 + per) - c0));
}

extern "C" __global__ void hc_pre_dot(float* part, const float* __restrict__ x, const float* __restrict__ fn,
                                      int rows, int mix, int width) {
    hc_dot_hint(fn, mix, width);
    pdl_enter();
    hc_dot_block<false>(part, x, fn, rows, mix, width, nullptr, nullptr, nullptr, nullptr, 0, 0);
}

// hc_post and the next HC_PRE's hc_pre_dot in one launch (decode and exact-mode calls, where the
// next HC_PRE takes hc_pre_dot): see hc_dot_block.
extern "C" __global__ void hc_post_dot(float* out, float* part, const float* f, const float* x, const float* post,
                                       const float* comb, const float* __restrict__ fn, int rows, int n, int d,
                                       int mix) {
    hc_dot_hint(fn, mix, n * d);
    pdl_enter();
    hc_dot_block<true>(part, x, fn, rows, mix, n * d, out, f, post, comb, n, d);
}

// hc_pre_dot's partial sums for prefill-sized calls (fast mode, 256 rows and more; V4's n = 4,
// width a multiple of 4·32·HC_SPLIT): block (s, rg) takes 8·R rows and column slice s for all
// mix + 1 outputs, warp w rows R·w.., lane l the slice's columns 4l..4l+3, 4l+128.. (16-byte
// loads): x is read once and the fn slice (48 KB) once a warp (L1). Slices run fastest in the
// grid, so the blocks in flight read whole rows (row groups fastest, so that an SM's blocks
// would share a slice in L1, measured slower: 635 against 511 µs a call on an 8K-token chunk). hc_pre_dot's blocks of 4 rows × 8
// outputs re-read each row for every output group (~260K blocks for an 8K-token chunk, 3.3 ms a
// call on the H200); the first version of this kernel (4-byte loads, 4 rows a warp) kept 512
// bytes a warp in flight and ran at 0.88 TB/s (609 µs a call). The same layout
// [rows, HC_SPLIT, mix + 1]; the sums' order differs from hc_pre_dot's (batch invariance holds
// only up to 16 rows in fast mode).
template <int N, int R>
__device__ __forceinline__ void hc_pre_dot_rows_t(float* part, const float* __restrict__ x,
                                                  const float* __restrict__ fn, int rows, int width) {
    constexpr int MIX = (2 + N) * N, MO = MIX + 1;
    int s = blockIdx.x, r0 = blockIdx.y * 8 * R + (threadIdx.x >> 5) * R, lane = threadIdx.x & 31;
    int per = width / HC_SPLIT, c0 = s * per, c1 = c0 + per;
    float acc[R][MO];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int o = 0; o < MO; o++) acc[r][o] = 0.f;
#pragma unroll 1
    for (int c = c0 + 4 * lane; c < c1; c += 128) {
        float4 xv[R];
#pragma unroll
        for (int r = 0; r < R; r++)
            xv[r] = r0 + r < rows ? *(const float4*)(x + (long long)(r0 + r) * width + c) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int o = 0; o < MIX; o++) {
            float4 w = *(const float4*)(fn + (long long)o * width + c);
#pragma unroll
            for (int r = 0; r < R; r++) {
                acc[r][o] = fmaf(w.x, xv[r].x, acc[r][o]);
                acc[r][o] = fmaf(w.y, xv[r].y, acc[r][o]);
                acc[r][o] = fmaf(w.z, xv[r].z, acc[r][o]);
                acc[r][o] = fmaf(w.w, xv[r].w, acc[r][o]);
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            acc[r][MIX] = fmaf(xv[r].x, xv[r].x, acc[r][MIX]);
            acc[r][MIX] = fmaf(xv[r].y, xv[r].y, acc[r][MIX]);
            acc[r][MIX] = fmaf(xv[r].z, xv[r].z, acc[r][MIX]);
            acc[r][MIX] = fmaf(xv[r].w, xv[r].w, acc[r][MIX]);
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int o = 0; o < MO; o++) {
            float v = warp_sum(acc[r][o]);
            if (lane == 0 && r0 + r < rows) part[((long long)(r0 + r) * HC_SPLIT + s) * MO + o] = v;
        }
}

// Rows a warp of hc_pre_dot_rows (a block: 8 warps).
#ifndef HC_DOT_R
#define HC_DOT_R 2
#endif

extern "C" __global__ void __launch_bounds__(256, 3) hc_pre_dot_rows(float* part, const float* __restrict__ x,
                                                                const float* __restrict__ fn, int rows, int width) {
    pdl_enter();
    hc_pre_dot_rows_t<4, HC_DOT_R>(part, x, fn, rows, width);
}

// d += a · b for one m16n8k8 step on TF32 operands (f32 registers whose low 13 mantissa bits
// the tensor core ignores), f32 accumulation. Fragments (PTX ISA, mma.m16n8k8 .tf32): a0..a3 =
// A[g][t], A[g + 8][t], A[g][t + 4], A[g + 8][t + 4]; b0, b1 = B[t][g], B[t + 4][g]; d0..d3 =
// D[g][2t], D[g][2t + 1], D[g + 8][2t], D[g + 8][2t + 1] (lane = 4g + t).
__device__ __forceinline__ void mma_tf32_1688(float* d, const float* a, float b0, float b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(__float_as_uint(a[0])), "r"(__float_as_uint(a[1])), "r"(__float_as_uint(a[2])),
          "r"(__float_as_uint(a[3])), "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
}

// v as a TF32 pair: hi = v with its low 13 mantissa bits cleared (a TF32 value), lo = v − hi
// (exact in f32; the tensor core reads its top 11 significant bits). hi + lo carries all but
// ~2^-21 of v, and the three products hi·hi + hi·lo + lo·hi of two such pairs are an f32-grade
// product (the 3xTF32 of CUTLASS; lo·lo, ~2^-22 of it, is dropped). A NaN or ±∞ gives lo NaN,
// so it reaches the sum.
__device__ __forceinline__ void tf32_split(float v, float& hi, float& lo) {
    hi = __uint_as_float(__float_as_uint(v) & 0xffffe000u);
    lo = v - hi;
}

// hc_pre_dot_rows on tensor cores (fast mode, prefill-sized calls, n = 4: 24 outputs): warp w
// of block (sg, rg) takes rows 16·rg.. and column slice 8·sg + w, the [16 rows × 24 outputs]
// tile as three m16n8k8 products in 3xTF32 over the slice's columns, and the rows' sums of
// squares (output 24) in f32 FMAs beside them. The f32 kernel ran at ~1 TB/s, bound by L1
// (ncu: L1/TEX 74 % of its throughput, the 24 fn rows re-read for every 2 rows); here 16 rows
// share each fn load. Columns map to k freely (the sum's order is the tensor core's either
// way): lane (g, t) loads columns c + 4t..c + 4t + 3 of rows g and g + 8 and of fn rows 8j + g
// (16-byte loads), the first two as one k8 step's k = t, t + 4, the last two as the next's.
// The same [rows, HC_SPLIT, 25] layout as hc_pre_dot.
extern "C" __global__ void __launch_bounds__(256) hc_pre_dot_tc(float* part, const float* __restrict__ x,
                                                              const float* __restrict__ fn, int rows, int width) {
    pdl_enter();
    constexpr int MIX = 24, MO = MIX + 1;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int s = blockIdx.x * 8 + warp, r0 = blockIdx.y * 16;
    int per = width / HC_SPLIT, c0 = s * per;
    bool in0 = r0 + g < rows, in1 = r0 + g + 8 < rows;
    const float* x0 = x + (long long)(in0 ? r0 + g : 0) * width + c0 + 4 * t;
    const float* x1 = x + (long long)(in1 ? r0 + g + 8 : 0) * width + c0 + 4 * t;
    const float* f0 = fn + (long long)g * width + c0 + 4 * t;
    float acc[3][4], sq[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 3; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[j][e] = 0.f;
    const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int c = 0; c < per; c += 16) {
        float4 a0 = in0 ? *(const float4*)(x0 + c) : z, a1 = in1 ? *(const float4*)(x1 + c) : z;
        float4 w[3];
#pragma unroll
        for (int j = 0; j < 3; j++) w[j] = *(const float4*)(f0 + (long long)8 * j * width + c);
        sq[0] = fmaf(a0.x, a0.x, sq[0]);
        sq[0] = fmaf(a0.y, a0.y, sq[0]);
        sq[0] = fmaf(a0.z, a0.z, sq[0]);
        sq[0] = fmaf(a0.w, a0.w, sq[0]);
        sq[1] = fmaf(a1.x, a1.x, sq[1]);
        sq[1] = fmaf(a1.y, a1.y, sq[1]);
        sq[1] = fmaf(a1.z, a1.z, sq[1]);
        sq[1] = fmaf(a1.w, a1.w, sq[1]);
        // Two k8 steps: (x, y) then (z, w) of each 4 columns.
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float ah[4], al[4];
            tf32_split(h ? a0.z : a0.x, ah[0], al[0]);
            tf32_split(h ? a1.z : a1.x, ah[1], al[1]);
            tf32_split(h ? a0.w : a0.y, ah[2], al[2]);
            tf32_split(h ? a1.w : a1.y, ah[3], al[3]);
#pragma unroll
            for (int j = 0; j < 3; j++) {
                float bh0, bl0, bh1, bl1;
                tf32_split(h ? w[j].z : w[j].x, bh0, bl0);
                tf32_split(h ? w[j].w : w[j].y, bh1, bl1);
                mma_tf32_1688(acc[j], al, bh0, bh1);
                mma_tf32_1688(acc[j], ah, bl0, bl1);
                mma_tf32_1688(acc[j], ah, bh0, bh1);
            }
        }
    }
    // The rows' squares over the quad's columns.
#pragma unroll
    for (int r = 0; r < 2; r++) {
        sq[r] += __shfl_xor_sync(0xffffffffu, sq[r], 1);
        sq[r] += __shfl_xor_sync(0xffffffffu, sq[r], 2);
    }
    float* p0 = part + ((long long)(r0 + g) * HC_SPLIT + s) * MO;
    float* p1 = part + ((long long)(r0 + g + 8) * HC_SPLIT + s) * MO;
#pragma unroll
    for (int j = 0; j < 3; j++) {
        int o = 8 * j + 2 * t;
        if (in0) {
            p0[o] = acc[j][0];
            p0[o + 1] = acc[j][1];
        }
        if (in1) {
            p1[o] = acc[j][2];
            p1[o + 1] = acc[j][3];
        }
    }
    if (t == 0) {
        if (in0) p0[MIX] = sq[0];
        if (in1) p1[MIX] = sq[1];
    }
}

// Row i's HC_PRE head (the blocks of hc_pre_apply and hc_pre_apply_norm): adds the row's
// HC_SPLIT partials in slice order, applies ρ and forms pre in shared memory; block `sink` forms
// post and the Sinkhorn comb instead and returns true (it has no columns to mix). base and scale
// are loaded with the partials (after them they were a second memory round trip before the
// Sinkhorn).
__device__ bool hc_pre_head(float* pre, float* post, float* comb, const float* __restrict__ part, const float* base,
                            const float* scale, int n, int d, int iters, float rms_eps, float hc_eps, int sink) {
    __shared__ float mv[(2 + MAX_HC) * MAX_HC + 1];
    __shared__ float a[MAX_HC * MAX_HC];
    __shared__ float cm[MAX_HC * MAX_HC];
    int i = blockIdx.y, mix = (2 + n) * n, t = threadIdx.x;
    float bt = t < mix ? base[t] : 0.f, sc0 = scale[0], sc1 = scale[1], sc2 = scale[2];
    if (t <= mix) {
        const float* p = part + (long long)i * HC_SPLIT * (mix + 1) + t;
        float v = 0.f;
        for (int s = 0; s < HC_SPLIT; s++) v += p[s * (mix + 1)];
        mv[t] = v;
    }
    __syncthreads();
    float rho = 1.0f / sqrtf(mv[mix] / (float)(n * d) + rms_eps);
    if (t < n) pre[t] = sigmoid_(mv[t] * rho * sc0 + bt) + hc_eps;
    // The Sinkhorn block runs beside the others' mix instead of before one block's share of it.
    if ((int)blockIdx.x == sink) {
        if (t >= n && t < 2 * n) post[i * n + t - n] = 2.0f * sigmoid_(mv[t] * rho * sc1 + bt);
        else if (t >= 2 * n && t < mix) a[t - 2 * n] = mv[t] * rho * sc2 + bt;
        __syncthreads();
        // In shared memory (its ~2·iters dependent passes would each wait on global memory).
        if (t < 32) {
            if (n * n <= 32) sinkhorn_small(cm, a, n, iters, hc_eps);
            else sinkhorn_warp(cm, a, n, iters, hc_eps);
        }
        __syncthreads();
        for (int j = t; j < n * n; j += blockDim.x) comb[(long long)i * n * n + j] = cm[j];
        return true;
    }
    __syncthreads();
    return false;
}

// Grid (⌈d / 1024⌉ + 1, rows): the last block forms post and comb, the others mix 1024 columns.
extern "C" __global__ void hc_pre_apply(float* y, float* post, float* comb, const float* __restrict__ x,
                                        const float* __restrict__ part, const float* base, const float* scale, int n,
                                        int d, int iters, float rms_eps, float hc_eps) {
    pdl_enter();
    __shared__ float pre[MAX_HC];
    if (hc_pre_head(pre, post, comb, part, base, scale, n, d, iters, rms_eps, hc_eps, gridDim.x - 1)) return;
    int i = blockIdx.y, t = threadIdx.x;
    const float* xr = x + (long long)i * n * d;
    for (int c = blockIdx.x * 4 * blockDim.x + t; c < min(d, (blockIdx.x + 1) * 4 * (int)blockDim.x); c += blockDim.x) {
        float acc = 0.f;
#pragma unroll
        for (int s = 0; s < MAX_HC; s++)
            if (s < n) acc += pre[s] * xr[s * d + c];
        y[(long long)i * d + c] = acc;
    }
}

// quant_block32 of four blocks at once (value u of lane i is value i of block u): the same codes
// and scales (the maxima are exact whatever the order; a block with a NaN or ±∞ gives codes 0 and
// scale NaN whatever its maximum), with the four maxima through one transposing butterfly (6
// shuffles instead of 20: after the xor-16 and xor-8 steps lane i holds block (i >> 3) & 3) and
// each lane dividing for one block (2 divisions a warp instead of 8), the scales then broadcast.
__device__ __forceinline__ void quant4_block32(const float v[4], signed char q[4], float d_out[4]) {
    int lane = threadIdx.x & 31;
    float a[4];
    unsigned bad = 0;
#pragma unroll
    for (int u = 0; u < 4; u++) {
        a[u] = fabsf(v[u]);
        if (__any_sync(0xffffffffu, !(a[u] <= 3.402823466e38f))) bad |= 1u << u;
    }
    bool h16 = lane & 16, h8 = lane & 8;
    float k0 = h16 ? a[2] : a[0], k1 = h16 ? a[3] : a[1];  // the pair this half keeps
    float s0 = h16 ? a[0] : a[2], s1 = h16 ? a[1] : a[3];  // the pair the other half keeps
    k0 = fmaxf(k0, __shfl_xor_sync(0xffffffffu, s0, 16));
    k1 = fmaxf(k1, __shfl_xor_sync(0xffffffffu, s1, 16));
    float m = h8 ? k1 : k0, o = h8 ? k0 : k1;
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, o, 8));
    for (int off = 4; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float d = __fdiv_rn(m, 127.f);
    float id = d != 0.f ? __fdiv_rn(1.f, d) : 0.f;
#pragma unroll
    for (int u = 0; u < 4; u++) {
        float du = __shfl_sync(0xffffffffu, d, 8 * u), iu = __shfl_sync(0xffffffffu, id, 8 * u);
        bool b = (bad >> u) & 1;
        int qq = b ? 0 : (int)roundf(__fmul_rn(v[u], iu));
        d_out[u] = b ? __int_as_float(0x7fc00000) : du;
        q[u] = (signed char)max(-127, min(127, qq));
    }
}

// Block 0 of hc_pre_apply_norm for n = N ≤ 4 streams and d ≤ 4·blockDim columns (V4: 4 × 4096
// on 1024 threads), one memory round trip deep: every global load the row needs (the thread's
// ≤ 4 columns of the n streams and of the norm weight, base, scale, and the HC_SPLIT partials
// through shared memory) is issued at once; warp 0 adds the partials (lane o output o) and forms
// ρ and pre; each thread mixes its columns in registers, writes y, and normalises them without
// reading y back. The operations and their order are hc_pre_head's, hc_mix's and
// rms_norm_slice's (thread t's columns t + u·blockDim, u = 0..3, are rms_norm_slice's j = u; the
// twin through quant4_block32, quant_block32's values), so every value is bitwise the general
// path's and the `rms_norm` launch's of this block size. FULL: d == 4·blockDim (no guards).
template <int N, bool FULL>
__device__ __forceinline__ void hc_pre_norm_row(float* y, float* a, signed char* xq, float* xd,
                                                const float* __restrict__ x, const float* __restrict__ part,
                                                const float* base, const float* scale, const float* nw, int d,
                                                float rms_eps, float hc_eps, int twin, float* pre, float* sh) {
    constexpr int MIX = (2 + N) * N, CPT = 4;
    static_assert(MIX < 32, "warp 0 holds the partial sums");
    __shared__ float sp[HC_SPLIT * (MIX + 1)];
    __shared__ float rr;  // the norm's 1/rms
    int t = threadIdx.x, lane = t & 31, wp = t >> 5, bd = blockDim.x;
    long long i = blockIdx.y, row = i * d;
    const float* xr = x + i * N * d + t;
    const float* wr = nw + t;
    float xv[CPT][N], wv[CPT];
#pragma unroll
    for (int u = 0; u < CPT; u++) {
        bool in = FULL || t + u * bd < d;
#pragma unroll
        for (int s = 0; s < N; s++) xv[u][s] = in ? xr[s * d + u * bd] : 0.f;
        wv[u] = in ? wr[u * bd] : 1.f;
    }
    // The partials through shared memory, one coalesced load a thread (in warp 0's registers,
    // 32 loads a lane beside the columns' 20 overflowed 64 registers and went out in two waves).
    float bt = lane < N ? base[lane] : 0.f, sc0 = scale[0];
    const float* p = part + i * HC_SPLIT * (MIX + 1);
#pragma unroll 1
    for (int e = t; e < HC_SPLIT * (MIX + 1); e += bd) sp[e] = p[e];
    __syncthreads();
    if (wp == 0) {
        float v = 0.f;
#pragma unroll
        for (int s = 0; s < HC_SPLIT; s++) v += sp[s * (MIX + 1) + min(lane, MIX)];
        float ms = __shfl_sync(0xffffffffu, v, MIX);  // the row's Σ x² (output mix)
        float rho = 1.0f / sqrtf(ms / (float)(N * d) + rms_eps);
        if (lane < N) pre[lane] = sigmoid_(v * rho * sc0 + bt) + hc_eps;
    }
    __syncthreads();
    float pr[N];
#pragma unroll
    for (int s = 0; s < N; s++) pr[s] = pre[s];
    float yv[CPT], ss = 0.f;
    float* yr = y + row + t;
#pragma unroll
    for (int u = 0; u < CPT; u++) {
        float acc = 0.f;
#pragma unroll
        for (int s = 0; s < N; s++) acc += pr[s] * xv[u][s];
        yv[u] = acc;
        if (FULL || t + u * bd < d) yr[u * bd] = acc;
    }
#pragma unroll
    for (int u = 0; u < CPT; u++)
        if (FULL || t + u * bd < d) ss += yv[u] * yv[u];
    // block_sum's sum (without its leading barrier: sh is not in use before it), its serial
    // add of the warp partials and r formed by warp 0 alone (in every warp they cost 32 warps ×
    // ~85 issue slots on one SM; one more barrier instead).
    ss = warp_sum(ss);
    if (lane == 0) sh[wp] = ss;
    __syncthreads();
    if (wp == 0) {
        float tot = 0.f;
        for (int k = 0; k < (bd >> 5); k++) tot += sh[k];
        if (lane == 0) rr = 1.0f / sqrtf(tot / (float)d + rms_eps);
    }
    __syncthreads();
    float r = rr;
    float ov[CPT];
    float* ar = a + row + t;
#pragma unroll
    for (int u = 0; u < CPT; u++) {
        ov[u] = yv[u] * r * wv[u];
        if (FULL || t + u * bd < d) ar[u * bd] = ov[u];
    }
    if (twin) {  // d a multiple of 32: a warp's columns u are one block, all in or all out
        signed char q[CPT];
        float dq[CPT];
        quant4_block32(ov, q, dq);
        signed char* qr = xq + row + t;
#pragma unroll
        for (int u = 0; u < CPT; u++) {
            if (!(FULL || t + u * bd < d)) continue;
            qr[u * bd] = q[u];
            if (lane == 0) xd[(row + t + u * bd) >> 5] = dq[u];
        }
    }
}

// Row i's post and comb for n = N ≤ 4, one warp (warp 0 of hc_pre_apply_norm's block 1, or a
// warp of hc_pre_sink_rows; am: N·N floats of the warp's shared memory): the row's
// partial sums in lane o's registers (all HC_SPLIT loads issued together, with base and scale),
// ρ by a shuffle, post, then the Sinkhorn comb written from the lanes' registers: hc_pre_head's
// operations without its three block barriers and shared-memory hops.
template <int N>
__device__ __forceinline__ void hc_sink_row(float* post, float* comb, const float* __restrict__ part,
                                            const float* base, const float* scale, int d, int iters, float rms_eps,
                                            float hc_eps, long long i, float* am) {
    constexpr int MIX = (2 + N) * N;
    static_assert(MIX < 32 && N * N <= 32, "one warp");
    int t = threadIdx.x & 31;
    bool on = t <= MIX;
    float bt = t < MIX ? base[t] : 0.f, sc1 = scale[1], sc2 = scale[2];
    const float* p = part + i * HC_SPLIT * (MIX + 1) + (on ? t : 0);
    float pv[HC_SPLIT];
#pragma unroll
    for (int s = 0; s < HC_SPLIT; s++) pv[s] = p[s * (MIX + 1)];
    float v = 0.f;
#pragma unroll
    for (int s = 0; s < HC_SPLIT; s++) v += pv[s];
    float ms = __shfl_sync(0xffffffffu, v, MIX);
    float rho = 1.0f / sqrtf(ms / (float)(N * d) + rms_eps);
    if (t >= N && t < 2 * N) post[i * N + t - N] = 2.0f * sigmoid_(v * rho * sc1 + bt);
    else if (t >= 2 * N && t < MIX) am[t - 2 * N] = v * rho * sc2 + bt;
    __syncwarp();
    sinkhorn_regn<N>(comb + i * N * N, am, iters, hc_eps);
}

// hc_pre_apply_norm's block 1 for many rows (prefill chunks), a warp a row, 8 rows a block: the
// same per-row code, so post and comb are bitwise block 1's. hc_pre_apply_norm then runs one
// block a row (grid (1, rows)): its 1024-thread blocks hold a whole SM each (64 registers a
// thread), and a sink block in that slot left the SM to one warp's latency-bound Sinkhorn for
// every row (747 µs a call for an 8K-token chunk, ~1 TB/s).
extern "C" __global__ void __launch_bounds__(256) hc_pre_sink_rows(float* post, float* comb,
                                                                  const float* __restrict__ part, const float* base,
                                                                  const float* scale, int rows, int d, int iters,
                                                                  float rms_eps, float hc_eps) {
    pdl_enter();
    __shared__ float am[8][16];
    int w = threadIdx.x >> 5;
    long long i = (long long)blockIdx.x * 8 + w;
    if (i >= rows) return;
    hc_sink_row<4>(post, comb, part, base, scale, d, iters, rms_eps, hc_eps, i, am[w]);
}

// hc_pre_apply_norm's paths other than V4's (block 0 with d < 4·blockDim, any n ≠ 4), out of
// line: the V4 path's code then runs from the kernel's start without jumping over them (a
// one-row launch fetches its instructions cold from L2: ncu saw 39 % of its stalls on
// instruction fetch, PERF.md v25).
__device__ __noinline__ void hc_pre_norm_part(float* y, float* a, signed char* xq, float* xd,
                                              const float* __restrict__ x, const float* __restrict__ part,
                                              const float* base, const float* scale, const float* nw, int d,
                                              float rms_eps, float hc_eps, int twin, float* pre, float* sh) {
    hc_pre_norm_row<4, false>(y, a, xq, xd, x, part, base, scale, nw, d, rms_eps, hc_eps, twin, pre, sh);
}

__device__ __noinline__ void hc_pre_norm_general(float* y, float* a, signed char* xq, float* xd, float* post,
                                                 float* comb, const float* __restrict__ x,
                                                 const float* __restrict__ part, const float* base,
                                                 const float* scale, const float* nw, int n, int d, int iters,
                                                 float rms_eps, float hc_eps, int twin, float* pre, float* sh) {
    if (hc_pre_head(pre, post, comb, part, base, scale, n, d, iters, rms_eps, hc_eps, 1)) return;
    long long i = blockIdx.y;
    hc_mix(y + i * d, x + i * n * d, pre, n, d);
    __syncthreads();  // y's writes are visible to the block's reads below
    rms_norm_slice(a, xq, xd, y, nw, 1, d, rms_eps, twin, i * d, 0, nullptr, 0, sh);
}

__device__ __noinline__ bool hc_pre_prefetch(const L2Ranges& pf) { return l2_prefetch_block(pf, 1); }

// HC_PRE apply and the RMSNorm after it in one launch, grid (2, rows): block 1 forms post and
// comb; block 0 mixes the whole row into y, then normalises it (rms_norm_slice: the same
// operations, in the same order, as the `rms_norm` launch of this block size) into `a`, with the
// int8 twin when `twin`. n = 4 and d ≤ 4·blockDim (V4) take hc_pre_norm_row and hc_sink_row.
// The blocks of the last pf.layers rows of y prefetch pf's ranges into L2 instead (common.cuh).
extern "C" __global__ void __launch_bounds__(1024) hc_pre_apply_norm(float* y, float* a, signed char* xq, float* xd, float* post, float* comb,
                                             const float* __restrict__ x, const float* __restrict__ part,
                                             const float* base, const float* scale, const float* nw, int n, int d,
                                             int iters, float rms_eps, float hc_eps, int twin, const __grid_constant__ L2Ranges pf) {
    if (pf.layers > 0 && hc_pre_prefetch(pf)) return;
    if (blockIdx.x == 0 && threadIdx.x == 0) WEIGHT_HINT(nw, 4LL * d);  // the norm's weight
    pdl_enter();
    __shared__ float pre[MAX_HC];
    __shared__ float sh[32];
    if (n == 4 && d <= 4 * (int)blockDim.x) {
        if (blockIdx.x == 1) {
            __shared__ float am[16];
            if (threadIdx.x < 32) hc_sink_row<4>(post, comb, part, base, scale, d, iters, rms_eps, hc_eps, blockIdx.y, am);
        }
        else if (d == 4 * (int)blockDim.x)
            hc_pre_norm_row<4, true>(y, a, xq, xd, x, part, base, scale, nw, d, rms_eps, hc_eps, twin, pre, sh);
        else hc_pre_norm_part(y, a, xq, xd, x, part, base, scale, nw, d, rms_eps, hc_eps, twin, pre, sh);
        return;
    }
    hc_pre_norm_general(y, a, xq, xd, post, comb, x, part, base, scale, nw, n, d, iters, rms_eps, hc_eps, twin, pre, sh);
}

// V consecutive floats at p (16-byte accesses for V = 4: p 16-byte aligned).
template <int V>
__device__ __forceinline__ void ld_v(float* v, const float* p) {
    if constexpr (V == 4) {
        float4 q = *(const float4*)p;
        v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    } else {
#pragma unroll
        for (int e = 0; e < V; e++) v[e] = p[e];
    }
}

template <int V>
__device__ __forceinline__ void st_v(float* p, const float* v) {
    if constexpr (V == 4) {
        *(float4*)p = make_float4(v[0], v[1], v[2], v[3]);
    } else {
#pragma unroll
        for (int e = 0; e < V; e++) p[e] = v[e];
    }
}

// X'[j] = post[j]·f + Σ_s comb[s][j]·X[s]. Thread (row i, columns c..c+V−1) forms all n
// streams' values of its columns from one load of f and of each X[s] (a thread an output
// element read each X value n times: ~4× the bytes, 1.5 ms a call for an 8K-token chunk on the
// H200). Each value's operations and their order are the same for every V, so hc_post4's
// values are hc_post's. Grid (column blocks, rows, striding past 65535).
template <int V>
__device__ __forceinline__ void hc_post_t(float* out, const float* f, const float* x, const float* post,
                                          const float* comb, int rows, int n, int d) {
    for (long long i = blockIdx.y; i < rows; i += gridDim.y) {
        const float* cr = comb + i * n * n;
        const float* xr = x + i * n * d;
        for (int c = V * (blockIdx.x * blockDim.x + threadIdx.x); c < d; c += V * gridDim.x * blockDim.x) {
            float xv[MAX_HC][V], fv[V];
#pragma unroll
            for (int s = 0; s < MAX_HC; s++) {
                if (s < n) ld_v<V>(xv[s], xr + (long long)s * d + c);
                else
#pragma unroll
                    for (int e = 0; e < V; e++) xv[s][e] = 0.f;
            }
            ld_v<V>(fv, f + i * d + c);
#pragma unroll
            for (int j = 0; j < MAX_HC; j++) {
                if (j >= n) break;
                float pj = post[i * n + j], v[V];
#pragma unroll
                for (int e = 0; e < V; e++) v[e] = pj * fv[e];
#pragma unroll
                for (int s = 0; s < MAX_HC; s++)
                    if (s < n) {
                        float cs = cr[s * n + j];
#pragma unroll
                        for (int e = 0; e < V; e++) v[e] += cs * xv[s][e];
                    }
                st_v<V>(out + (i * n + j) * d + c, v);
            }
        }
    }
}

// A column a thread (decode rows, any d).
extern "C" __global__ void hc_post(float* out, const float* f, const float* x, const float* post, const float* comb,
                                   int rows, int n, int d) {
    pdl_enter();
    hc_post_t<1>(out, f, x, post, comb, rows, n, d);
}

// Four columns a thread in 16-byte accesses, for prefill-sized calls with d a multiple of 4
// (hc_post's 4-byte ones ran at ~2.5 TB/s on an 8K-token chunk: 467 µs a call, this 284).
extern "C" __global__ void hc_post4(float* out, const float* f, const float* x, const float* post, const float* comb,
                                    int rows, int n, int d) {
    pdl_enter();
    hc_post_t<4>(out, f, x, post, comb, rows, n, d);
}

// HC_HEAD: y = Σ_s (σ(ρ·m_s·scale + base_s) + eps)·X_s, one block per row.
extern "C" __global__ void hc_head(float* y, const float* x, const float* m, const float* base, const float* scale,
                                   int n, int d, float rms_eps, float hc_eps) {
    pdl_enter();
    __shared__ float sh[32];
    __shared__ float pre[MAX_HC];
    int i = blockIdx.x;
    const float* xr = x + (long long)i * n * d;
    float rho = hc_rho(xr, n * d, rms_eps, sh);
    int t = threadIdx.x;
    if (t < n) pre[t] = sigmoid_(m[(long long)i * n + t] * rho * scale[0] + base[t]) + hc_eps;
    __syncthreads();
    hc_mix(y + (long long)i * d, xr, pre, n, d);
}
