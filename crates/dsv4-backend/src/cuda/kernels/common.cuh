// Shared helpers, prepended to every kernel file before NVRTC compiles it.
#define INFINITY __int_as_float(0x7f800000)

// moe_sort's slot records, after its active list (active[0..ne + 1], padded to 16 bytes): slot a
// is {expert, its first pair in order, its pairs, active experts} for a < active experts, zeros
// after. One load gives a block of the several-row expert kernels what active[ne], active[a]
// and off[e], off[e + 1] gave in three dependent trips (bf16.rs `moe_active_words`).
__device__ __forceinline__ uint4* moe_slots(unsigned* active, int ne) { return (uint4*)(active + ((ne + 4) & ~3)); }
__device__ __forceinline__ const uint4* moe_slots(const unsigned* active, int ne) {
    return (const uint4*)(active + ((ne + 4) & ~3));
}

// Row table layout (u32, see CudaRows): six arrays of n entries each.
#define ROW_SEQ(t) rows[(t)]
#define ROW_POS(t) rows[n + (t)]
#define ROW_TOKEN(t) rows[2 * n + (t)]
#define ROW_START(t) rows[3 * n + (t)]   // batch index of the first row of t's segment
#define ROW_POS0(t) rows[4 * n + (t)]    // position of that first row
#define ROW_LEN(t) rows[5 * n + (t)]     // rows in t's segment

// Programmatic dependent launch (cuda/launch.rs), the first statement of every kernel: wait until
// the grids this one depends on have completed and their writes are visible, then let the next
// grid in the stream be scheduled (its blocks then wait here in turn). Every block waits before it
// reads or writes anything, so each grid completes after its predecessor and the chain is
// transitive. Without the launch attribute both instructions return at once.
__device__ __forceinline__ void pdl_enter() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// A hint from the calling thread: L2 prefetch of [p, p + bytes)'s 16-byte-aligned interior
// (cp.async.bulk.prefetch: nothing to wait for; a GGUF row's codes and heads are 16-byte
// multiples at 16-byte-aligned offsets in the V4 shapes, so the interior is the whole row).
__device__ __forceinline__ void l2_hint(const void* p, long long bytes) {
    unsigned long long a = (unsigned long long)p, lo = (a + 15) & ~15ull, hi = (a + bytes) & ~15ull;
    if (hi <= lo) return;
    unsigned long long g;
    asm volatile("cvta.to.global.u64 %0, %1;" : "=l"(g) : "l"(lo));
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(g), "r"((unsigned)(hi - lo)) : "memory");
}

// Before pdl_enter in the latency-bound kernels: l2_hint of a weight span (nothing a kernel
// writes during a forward), so that its DRAM latency passes while the previous grid ends and the
// loads after the wait meet L2. A macro, so that a kernel file's variant can turn the hints off
// (`#undef PRE_WAIT_L2` / `#define PRE_WAIT_L2 0` at its top: the A/B).
#define PRE_WAIT_L2 1
#define WEIGHT_HINT(p, bytes)                      \
    do {                                           \
        if (PRE_WAIT_L2) l2_hint((p), (bytes));    \
    } while (0)

// pdl_enter after loads of data no kernel writes during a forward (weights), so that they fly
// while the previous kernel ends. ptxas hoists a plain wait above every load (it only delays
// them; tools/sass/pdl_order_probe.cu), so the wait is made to depend on `dep`, a value formed
// from one word of each such load (its value does not matter): the loads are issued first, and
// the wait runs once they have landed.
__device__ __forceinline__ void pdl_enter_after(unsigned dep) {
    asm volatile("{\n\t.reg .pred p;\n\tsetp.eq.u32 p, %0, 0x2545F491;\n\t@p griddepcontrol.wait;\n\t"
                 "@!p griddepcontrol.wait;\n\t}" ::"r"(dep)
                 : "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Up to L2_RANGES weight ranges the next kernels read (cuda/mod.rs `L2Ranges`), pulled into L2
// by the blocks of `layers` extra layers of a latency-bound kernel's grid (along x or y, as the
// kernel says) while its own blocks run. Such a block reads nothing a kernel writes (weights),
// so it skips pdl_enter and exits at once after queueing its share: the grid still completes
// after its predecessor (its own blocks wait).
#define L2_RANGES 8
struct L2Ranges {
    unsigned long long ptr[L2_RANGES];
    unsigned long long bytes[L2_RANGES];
    int n, layers;
};

// Share `b` of `nb`: the ranges' 16-byte-aligned interiors in chunks of 16 KB, chunk c to block
// c mod nb (consecutive chunks on different blocks' copy engines), then to its threads in turn
// (cp.async.bulk.prefetch: a hint, no completion to wait for).
__device__ __forceinline__ void l2_prefetch_share(const L2Ranges& r, int b, int nb) {
    const unsigned long long CH = 16384;
    long long stride = (long long)nb * blockDim.x;
    for (long long c = (long long)threadIdx.x * nb + b;; c += stride) {
        long long k = c;
        int i = 0;
        unsigned long long lo = 0, hi = 0;
        for (; i < r.n && i < L2_RANGES; i++) {
            lo = (r.ptr[i] + 15) & ~15ull;
            hi = (r.ptr[i] + r.bytes[i]) & ~15ull;
            long long nc = hi > lo ? (long long)((hi - lo + CH - 1) / CH) : 0;
            if (k < nc) break;
            k -= nc;
        }
        if (i >= r.n || i >= L2_RANGES) return;
        unsigned long long a = lo + (unsigned long long)k * CH, g;
        unsigned sz = (unsigned)(hi - a < CH ? hi - a : CH);
        asm volatile("cvta.to.global.u64 %0, %1;" : "=l"(g) : "l"(a));
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(g), "r"(sz) : "memory");
    }
}

// Whether this block lies in the grid's last r.layers layers along x (dim 0) or y (dim 1): if
// so it has queued its share of r's prefetch (every block of those layers takes one) and the
// kernel returns.
__device__ __forceinline__ bool l2_prefetch_block(const L2Ranges& r, int dim) {
    if (r.layers <= 0) return false;
    int gx = gridDim.x, gy = gridDim.y, gz = gridDim.z, bx = blockIdx.x, by = blockIdx.y, bz = blockIdx.z;
    int first = (dim == 0 ? gx : gy) - r.layers, at = dim == 0 ? bx : by;
    if (at < first) return false;
    int other = dim == 0 ? by : bx, nother = dim == 0 ? gy : gx;
    l2_prefetch_share(r, ((at - first) * nother + other) * gz + bz, r.layers * nother * gz);
    return true;
}

#define GRID_STRIDE(i, total) \
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (total); \
         i += (long long)gridDim.x * blockDim.x)

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block (blockDim.x a multiple of 32). `sh` holds 32 floats. Every thread gets
// the same value (the warp partials are added in one fixed order).
__device__ float block_sum(float v, float* sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    float t = 0.f;
    for (int i = 0; i < nw; i++) t += sh[i];
    return t;
}

// One value of a block of 32 int8 activations (crate::x8), lane i of the (converged) warp holding
// value i: its code, and the block's scale in *d: d = max|x| / 127 (0 for an all-zero block),
// code = round(x / d); d = NaN and codes 0 for a block holding a NaN or ±∞ (its products are
// then NaN, which the step's nonfinite check sees). quant_x8 and the RMSNorm's twin use it.
__device__ __forceinline__ signed char quant_block32(float v, float* d_out) {
    float a = fabsf(v);
    int bad = __any_sync(0xffffffffu, !(a <= 3.402823466e38f));
    for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    float d = __fdiv_rn(a, 127.f);
    float id = d != 0.f ? __fdiv_rn(1.f, d) : 0.f;
    int q = bad ? 0 : (int)roundf(__fmul_rn(v, id));
    *d_out = bad ? __int_as_float(0x7fc00000) : d;
    return (signed char)max(-127, min(127, q));
}

// The add is explicit: in the files compiled with contraction on (bf16.cu, quant.cu) `1 + expf`
// would fuse with expf's last multiply, and a value would then depend on the file computing it.
__device__ __forceinline__ float sigmoid_(float x) { return 1.0f / __fadd_rn(1.0f, expf(-x)); }

#define MAX_K 16

__device__ __forceinline__ float sqrt_softplus(float z) {
    float sp = z > 20.0f ? z : log1pf(expf(z));
    return sqrtf(sp);
}

// The router's choice for row i (spec §6.1) on one (converged) warp: `sv` holds e floats and
// `ch` MAX_K of the warp's own. Hash layers take their ids from the `tid2eid` table `hash`
// [vocab, k] at the row's token (from the row table `rows`); learned layers take the top k of
// score + bias (ties to the lower expert id), in descending order: each lane scores its experts
// once, then k rounds of warp argmax. The logits are read through L2 (`__ldcg`: gemv_route's
// last block reads the other blocks' outputs). moe.cu's `route` and dense.cu's `gemv_route`
// (both compiled without contraction, so the same roundings).
__device__ __forceinline__ void route_row(unsigned* ids, float* wts, const float* logits, const float* bias,
                                          const unsigned* hash, const unsigned* rows, int use_hash, int n, int e,
                                          int k, int norm_topk, float scale, int i, float* sv, unsigned* ch) {
    int lane = threadIdx.x & 31;
    const float* z = logits + (long long)i * e;
    if (use_hash) {
        if (lane < k) ch[lane] = hash[(long long)ROW_TOKEN(i) * k + lane];
    } else {
        // A lane's first 8 logits and biases (e ≤ 256: all of V4's) loaded before any is
        // scored: in the strided loop each load waited for the previous score (sqrt_softplus
        // branches), 4–8 L2 round trips in turn, ~4 µs of gemv_route's 12.4 on learned layers
        // (7.1 on hash layers; PERF.md v25). The same values, stored in the same places.
        constexpr int AHEAD = 8;
        float zv[AHEAD], bv0[AHEAD];
#pragma unroll
        for (int q = 0; q < AHEAD; q++) {
            int c = lane + 32 * q;
            zv[q] = c < e ? __ldcg(z + c) : 0.f;
            bv0[q] = c < e ? bias[c] : 0.f;
        }
#pragma unroll
        for (int q = 0; q < AHEAD; q++)
            if (lane + 32 * q < e) sv[lane + 32 * q] = sqrt_softplus(zv[q]) + bv0[q];
        for (int c = lane + 32 * AHEAD; c < e; c += 32) sv[c] = sqrt_softplus(__ldcg(z + c)) + bias[c];
        __syncwarp();
        for (int j = 0; j < k; j++) {
            int best = -1;
            float bv = 0.f;
            for (int c = lane; c < e; c += 32) {
                float v = sv[c];
                if (v == -INFINITY) continue;  // taken
                if (best < 0 || v > bv) { best = c; bv = v; }
            }
            for (int o = 16; o > 0; o >>= 1) {
                float v2 = __shfl_xor_sync(0xffffffffu, bv, o);
                int b2 = __shfl_xor_sync(0xffffffffu, best, o);
                if (b2 >= 0 && (best < 0 || v2 > bv || (v2 == bv && b2 < best))) { best = b2; bv = v2; }
            }
            if (lane == 0) {
                ch[j] = (unsigned)best;
                sv[best] = -INFINITY;
            }
            __syncwarp();
        }
    }
    __syncwarp();
    // Lane j < k scores choice j (its logit loads in parallel: lane 0 alone waited on k loads in
    // turn, ~3 µs of the kernel's 5–9.5 µs); every lane adds the k scores in choice order.
    unsigned cj = lane < k ? ch[lane] : 0u;
    float sj = lane < k ? sqrt_softplus(__ldcg(z + cj)) : 0.f;
    float sum = 0.f;
    for (int j = 0; j < k; j++) sum += __shfl_sync(0xffffffffu, sj, j);
    if (lane < k) {
        float w = norm_topk ? sj / sum : sj;
        ids[(long long)i * k + lane] = cj;
        wts[(long long)i * k + lane] = w * scale;
    }
}

// out[r, o] = x[r, :] · w[o, :] for r < n (groups of 8 rows), f32 weights (mHC, router): one block of 256
// threads per output column, each thread a strided slice of k, then a fixed-order block sum —
// a decode row's product of a short, very wide matrix (mHC: 24 × 16384) gets the whole block.
//
// Each thread takes 4 consecutive values at a time (16-byte loads, 4 in flight: the whole
// 4096-wide router row in one round trip), in the same order for one row and for several.
// (gemv_f32's body: block blockIdx.x forms output column blockIdx.x; `sh` holds 32 floats.) The
// products and adds are explicit roundings, so that its values do not hang on whether the file
// that includes it is compiled with FMA contraction (tools/kernel_sass.py --fmad: the same SASS
// either way).
__device__ __forceinline__ void gemv_f32_block(float* out, const float* x, const float* w, int n, int k, int m,
                                               float* sh) {
    int o = blockIdx.x;
    if (o >= m) return;
    const float* wr = w + (long long)o * k;
    // float4 steps where the rows allow (k a multiple of 4 and 16-byte aligned bases), the
    // tail (or everything) one value at a time.
    int k4 = ((k & 3) == 0 && (((unsigned long long)w | (unsigned long long)x) & 15) == 0) ? k / 4 : 0;
    if (n == 1) {  // decode: one accumulator in a register
        float acc = 0.f;
#pragma unroll 4
        for (int c = threadIdx.x; c < k4; c += blockDim.x) {
            float4 a = ((const float4*)wr)[c], b = ((const float4*)x)[c];
            acc = __fadd_rn(acc, __fmul_rn(a.x, b.x));
            acc = __fadd_rn(acc, __fmul_rn(a.y, b.y));
            acc = __fadd_rn(acc, __fmul_rn(a.z, b.z));
            acc = __fadd_rn(acc, __fmul_rn(a.w, b.w));
        }
        for (int c = 4 * k4 + threadIdx.x; c < k; c += blockDim.x) acc = __fadd_rn(acc, __fmul_rn(wr[c], x[c]));
        float v = block_sum(acc, sh);
        if (threadIdx.x == 0) out[o] = v;
        return;
    }
    // Several rows: groups of 8, each row's sum in the same order whatever the group or n; the
    // grid's y takes every gridDim.y-th group (gemv_route's grid has one).
    for (int r0 = 8 * blockIdx.y; r0 < n; r0 += 8 * gridDim.y) {
        int nr = min(8, n - r0);
        const float* xr = x + (long long)r0 * k;
        float acc[8];
#pragma unroll
        for (int j = 0; j < 8; j++) acc[j] = 0.f;
        for (int c = threadIdx.x; c < k4; c += blockDim.x) {
            float4 a = ((const float4*)wr)[c];
#pragma unroll
            for (int j = 0; j < 8; j++)
                if (j < nr) {
                    float4 b = ((const float4*)(xr + (long long)j * k))[c];
                    acc[j] = __fadd_rn(acc[j], __fmul_rn(a.x, b.x));
                    acc[j] = __fadd_rn(acc[j], __fmul_rn(a.y, b.y));
                    acc[j] = __fadd_rn(acc[j], __fmul_rn(a.z, b.z));
                    acc[j] = __fadd_rn(acc[j], __fmul_rn(a.w, b.w));
                }
        }
        for (int c = 4 * k4 + threadIdx.x; c < k; c += blockDim.x) {
            float wv = wr[c];
#pragma unroll
            for (int j = 0; j < 8; j++)
                if (j < nr) acc[j] = __fadd_rn(acc[j], __fmul_rn(wv, xr[(long long)j * k + c]));
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            if (j >= nr) break;
            float v = block_sum(acc[j], sh);
            if (threadIdx.x == 0) out[(long long)(r0 + j) * m + o] = v;
        }
    }
}

// The router's logits (gemv_f32_block, one block an expert: blocks 0..m) and its choice
// (route_row, a warp a row) by the last of those blocks to finish its column (cnt: a zeroed
// counter, left zero; the pattern of quant.cu's quant_groups), its warps taking rows in turn.
// `sv`: the dynamic shared memory, min(n, blockDim / 32)·m floats, a routing warp's scores.
// dense.cu's gemv_route (route_row's and block_sum's code is the same with contraction on or off:
// tools/kernel_sass.py --fmad).
__device__ __forceinline__ void gemv_route_block(float* out, const float* x, const float* w, int n, int k, int m,
                                                 unsigned* cnt, unsigned* ids, float* wts, const float* bias,
                                                 const unsigned* hash, const unsigned* rows, int use_hash, int topk,
                                                 int norm_topk, float scale, float* sv) {
    __shared__ float sh[32];
    __shared__ unsigned ch[32][MAX_K];
    __shared__ unsigned last;
    gemv_f32_block(out, x, w, n, k, m, sh);
    __syncthreads();  // thread 0's stores of this block's column made
    if (threadIdx.x == 0) {
        __threadfence();
        unsigned prev = atomicAdd(cnt, 1u);
        last = prev == (unsigned)m - 1;
        if (last) {
            *cnt = 0;  // every block has counted: ready for the next launch
            __threadfence();
        }
    }
    __syncthreads();
    if (!last) return;
    int wp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int i = wp; i < n; i += nw)
        route_row(ids, wts, out, bias, hash, rows, use_hash, n, m, topk, norm_topk, scale, i, sv + wp * m, ch[wp]);
}

// RMSNorm of the `group`-wide slice at `base` of x into out (the block's first nt threads, nt a
// multiple of 32; see dense.cu's rms_norm for twin and the RoPE of npairs pairs at position pos);
// `sh` holds 32 floats. Every thread of the block calls it. With nt below the block's size the
// values are those of a block of nt threads bit for bit: the other warps add their zero sums
// after the real ones in block_sum's order (s + 0 = s for the non-negative sum of squares).
__device__ void rms_norm_slice_nt(float* out, signed char* xq, float* xd, const float* x, const float* w, int has_w,
                                  int group, float eps, int twin, long long base, long long pos,
                                  const double* freqs, int npairs, float* sh, int nt) {
    int r0 = group - 2 * npairs;
    const float* g = x + base;
    float* o = out + base;
    int t = threadIdx.x;
    // Loads of 8 strided elements issued before their adds (same order of the sum): a lone
    // block (one decode row) would otherwise wait for each load in turn.
    float s = 0.f;
    for (int c0 = t < nt ? t : group; c0 < group; c0 += 8 * nt) {
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int c = c0 + j * nt;
            v[j] = c < group ? g[c] : 0.f;
        }
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (c0 + j * nt < group) s += v[j] * v[j];
    }
    s = block_sum(s, sh);
    float r = 1.0f / sqrtf(s / (float)group + eps);
    for (int c0 = t < nt ? t : group; c0 < group; c0 += 8 * nt) {
        float v[8], wv[8];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int c = c0 + j * nt;
            v[j] = c < group ? g[c] : 0.f;
            wv[j] = (has_w && c < group) ? w[c] : 1.f;
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int c = c0 + j * nt;
            if (c >= group) break;  // uniform in the warp when twin or rope (group a multiple of 32)
            float y = has_w ? v[j] * r * wv[j] : v[j] * r;
            if (npairs > 0) {
                float p = __shfl_xor_sync(0xffffffffu, y, 1);  // the pair's other value
                if (c >= r0) {
                    double th = (double)pos * freqs[(c - r0) >> 1];
                    float s = (float)sin(th), cs = (float)cos(th);
                    y = ((c - r0) & 1) == 0 ? y * cs - p * s : p * s + y * cs;
                }
            }
            o[c] = y;
            if (twin) {
                float d;
                xq[base + c] = quant_block32(y, &d);
                if ((threadIdx.x & 31) == 0) xd[(base + c) >> 5] = d;
            }
        }
    }
}

// rms_norm_slice_nt on all of the block's threads.
__device__ __forceinline__ void rms_norm_slice(float* out, signed char* xq, float* xd, const float* x, const float* w,
                                               int has_w, int group, float eps, int twin, long long base,
                                               long long pos, const double* freqs, int npairs, float* sh) {
    rms_norm_slice_nt(out, xq, xd, x, w, has_w, group, eps, twin, base, pos, freqs, npairs, sh, blockDim.x);
}

// bf16 tensor-core helpers of the many-row kernels (gemm.cu's tiles, attention.cu's
// attention_tc and index_score_tc).
__device__ __forceinline__ void ldsm_x4(unsigned* r, const unsigned short* p) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned* r, const unsigned short* p) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
// c += a · b on mma.m16n8k16 (bf16 in, f32 accumulation): a the A fragment's 4 registers.
__device__ __forceinline__ void mma_bf16_16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// A warp's two m16n8 accumulators of a 16-output tile (d0: activation rows 0..7, d1: rows
// 8..15; lane (g, t)) into part[output][row]: d[0], d[1] are output g, rows 2t, 2t + 1 of the
// n8 tile, d[2], d[3] output g + 8 (bf16.cu's gemvt_body, dspark.cu's markov_argmax).
__device__ __forceinline__ void mma_tile_part(float (*part)[17], const float* d0, const float* d1, int g, int t) {
    part[g][2 * t] = d0[0];
    part[g][2 * t + 1] = d0[1];
    part[g + 8][2 * t] = d0[2];
    part[g + 8][2 * t + 1] = d0[3];
    part[g][8 + 2 * t] = d1[0];
    part[g][9 + 2 * t] = d1[1];
    part[g + 8][8 + 2 * t] = d1[2];
    part[g + 8][9 + 2 * t] = d1[3];
}
// (a, b) rounded to bf16 (nearest even) in one instruction, a in the low half.
__device__ __forceinline__ unsigned bf2(float a, float b) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    return r;
}
