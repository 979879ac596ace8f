// Row gathers, elementwise ops, RMSNorm and RoPE. Launchers: cuda/mod.rs.

// out[i, :] = src[idx[i], :] (embedding lookup with token ids; select_rows).
extern "C" __global__ void gather_rows(float* out, const float* src, const unsigned* idx, int n, int cols) {
    pdl_enter();
    GRID_STRIDE(e, (long long)n * cols) {
        long long i = e / cols, c = e % cols;
        out[e] = src[(long long)idx[i] * cols + c];
    }
}

extern "C" __global__ void add(float* out, const float* a, const float* b, long long len) {
    pdl_enter();
    GRID_STRIDE(e, len) out[e] = a[e] + b[e];
}

// The chain bench (cuda/chain.rs): what a kernel boundary costs against a device-side barrier,
// the price a persistent decode kernel would save a stage. One link of a chain of dependent
// launches, as small as a kernel gets: each block's thread 0 adds one to its word.
extern "C" __global__ void chain_link(unsigned* words) {
    pdl_enter();
    if (threadIdx.x == 0) words[blockIdx.x] += 1;
}

// The same links in one launch, each ending in a grid-wide barrier: an arrival count bar[0] and
// a generation bar[1] (the last block to arrive resets the count, then bumps the generation the
// others spin on). Every block must be resident at once: gridDim.x at most the SMs (the caller's).
extern "C" __global__ void chain_barrier(unsigned* words, unsigned* bar, int links) {
    pdl_enter();
    volatile unsigned* gen = bar + 1;
    for (int i = 0; i < links; i++) {
        if (threadIdx.x == 0) words[blockIdx.x] += 1;
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned g = *gen;
            __threadfence();
            if (atomicAdd(bar, 1u) == gridDim.x - 1) {
                bar[0] = 0;
                __threadfence();
                atomicAdd(bar + 1, 1u);
            } else {
                while (*gen == g) __nanosleep(32);
            }
            __threadfence();
        }
        __syncthreads();
    }
}

// One thread waits `ns` nanoseconds (the global timer): queued at the start of each side branch
// under DSV4_SIDE_DELAY, so that a read of a branch's output without its join, or a buffer freed
// before the branch is done with it, meets the branch's work late and shows in the values.
extern "C" __global__ void side_delay(long long ns) {
    pdl_enter();
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while ((long long)(t - t0) < ns);
}

// dst[s, 0..len] = src[s, 0..len] for `count` blocks of strides sstride / dstride.
extern "C" __global__ void copy_blocks(float* dst, const float* src, int count, long long len, long long dstride,
                                       long long sstride) {
    pdl_enter();
    GRID_STRIDE(e, (long long)count * len) {
        long long s = e / len, i = e % len;
        dst[s * dstride + i] = src[s * sstride + i];
    }
}

// out[at_r .. at_r + len_r] = src_r[0 .. len_r] for region r of a table of (source address,
// length, destination offset) triples, one block a region: a snapshot's ~200 regions in one launch
// and one copy back instead of a copy a region.
extern "C" __global__ void gather_regions(float* out, const unsigned long long* table) {
    pdl_enter();
    const float* src = (const float*)table[3 * blockIdx.x];
    long long len = (long long)table[3 * blockIdx.x + 1], at = (long long)table[3 * blockIdx.x + 2];
    for (long long i = threadIdx.x; i < len; i += blockDim.x) out[at + i] = src[i];
}

// out[i, s*d + c] = x[i, c] for every mHC stream s.
extern "C" __global__ void hc_expand(float* out, const float* x, int rows, int d, int nstreams) {
    pdl_enter();
    GRID_STRIDE(e, (long long)rows * nstreams * d) {
        long long i = e / ((long long)nstreams * d), c = e % d;
        out[e] = x[i * d + c];
    }
}

// out[i, col + c] = (Σ_s x[i, s*d + c]) / nstreams, summed in stream order from 0 (cpu:
// `CpuBackend::stream_mean_into`, bitwise): DSpark's `main_hidden` tap (dspark §3.2).
extern "C" __global__ void stream_mean(float* out, const float* x, int rows, int d, int nstreams, int ocols,
                                       int col) {
    pdl_enter();
    GRID_STRIDE(e, (long long)rows * d) {
        long long i = e / d, c = e % d;
        float s = 0.0f;
        for (int k = 0; k < nstreams; k++) s = __fadd_rn(s, x[(i * nstreams + k) * d + c]);
        out[i * ocols + col + c] = __fdiv_rn(s, (float)nstreams);
    }
}

// Clamped SwiGLU activation: h = min(g, L)·σ(min(g, L))·clamp(u, −L, L).
extern "C" __global__ void swiglu_act(float* h, const float* g, const float* u, long long len, float limit) {
    pdl_enter();
    GRID_STRIDE(e, len) {
        float gv = fminf(g[e], limit);
        float uv = fminf(fmaxf(u[e], -limit), limit);
        h[e] = gv * sigmoid_(gv) * uv;
    }
}

// RMSNorm of one `group`-wide slice per block; w (when has_w) is `group` wide.
// twin: also write the output's int8 codes and block scales (xq, xd; see quant_block32) — group
// a multiple of 32, so each warp's 32 consecutive values below are one block.
// npairs > 0: then `rope` on each slice (group a multiple of 32: a pair's two values are in
// neighbouring lanes; slice s is row s / heads of the n-row table `rows`), the same operations.
extern "C" __global__ void __launch_bounds__(1024) rms_norm(float* out, signed char* xq, float* xd, const float* x, const float* w, int has_w,
                                    int group, float eps, int twin, const unsigned* rows, int n, int heads,
                                    const double* freqs, int npairs) {
    if (has_w && threadIdx.x == 0) WEIGHT_HINT(w, 4LL * group);
    pdl_enter();
    __shared__ float sh[32];
    long long base = (long long)blockIdx.x * group;
    long long pos = npairs > 0 ? (long long)ROW_POS(blockIdx.x / heads) : 0;
    rms_norm_slice(out, xq, xd, x, w, has_w, group, eps, twin, base, pos, freqs, npairs, sh);
}

// rms_norm for many groups of 32·NW·J values (the q norm of a prefill chunk: 8K rows × 64
// heads of 512), a warp a group, 8 groups a block: lane l plays threads l + 32w (w < NW) of
// rms_norm's NW-warp block, holding their J values each (value c = t + 32·NW·j) in registers.
// The sum is rms_norm's to the bit: each virtual thread's squares in j order, each virtual
// warp's butterfly (warp_sum on the same lanes), then the warp totals from 0 in w order
// (block_sum); the outputs are rms_norm_slice's operations (RoPE's pair partner is lane l ^ 1,
// as thread t ^ 1 there). rms_norm's blocks read each group twice around two barriers (1.2 ms
// a call for 524K groups of 512, ~1.7 TB/s). No int8 twin (the launcher keeps those on
// rms_norm).
template <int NW, int J>
__device__ __forceinline__ void rms_norm_warp_t(float* out, const float* x, const float* w, int has_w, float eps,
                                                const unsigned* rows, int n, int heads, long long groups,
                                                const double* freqs, int npairs) {
    constexpr int T = 32 * NW, G = T * J;
    long long gi = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (gi >= groups) return;
    int lane = threadIdx.x & 31, r0 = G - 2 * npairs;
    const float* g = x + gi * G;
    float* o = out + gi * G;
    float v[NW][J];
#pragma unroll
    for (int q = 0; q < NW; q++)
#pragma unroll
        for (int j = 0; j < J; j++) v[q][j] = g[lane + 32 * q + T * j];
    float tot = 0.f;
#pragma unroll
    for (int q = 0; q < NW; q++) {
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < J; j++) s += v[q][j] * v[q][j];
        tot += warp_sum(s);
    }
    float r = 1.0f / sqrtf(tot / (float)G + eps);
    long long pos = npairs > 0 ? (long long)ROW_POS(gi / heads) : 0;
#pragma unroll
    for (int j = 0; j < J; j++)
#pragma unroll
        for (int q = 0; q < NW; q++) {
            int c = lane + 32 * q + T * j;
            float y = has_w ? v[q][j] * r * w[c] : v[q][j] * r;
            if (npairs > 0) {
                float p = __shfl_xor_sync(0xffffffffu, y, 1);
                if (c >= r0) {
                    double th = (double)pos * freqs[(c - r0) >> 1];
                    float sn = (float)sin(th), cs = (float)cos(th);
                    y = ((c - r0) & 1) == 0 ? y * cs - p * sn : p * sn + y * cs;
                }
            }
            o[c] = y;
        }
}

// Groups of 512 on rms_norm's 128 threads (norm_values 4): V4's q and kv heads.
extern "C" __global__ void __launch_bounds__(256) rms_norm_warp(float* out, const float* x, const float* w, int has_w,
                                                              float eps, const unsigned* rows, int n, int heads,
                                                              long long groups, const double* freqs, int npairs) {
    pdl_enter();
    rms_norm_warp_t<4, 4>(out, x, w, has_w, eps, rows, n, heads, groups, freqs, npairs);
}

// Pair e (row, head, pair) of `rope`: the rotation of one interleaved pair in place.
__device__ __forceinline__ void rope_pair(float* x, const unsigned* rows, int n, const double* freqs, int npairs,
                                          int cols, int head, int inverse, long long e) {
    int heads = cols / head;
    long long i = e / ((long long)heads * npairs);
    int h = (int)(e / npairs % heads), j = (int)(e % npairs);
    double th = (double)ROW_POS(i) * freqs[j];
    if (inverse) th = -th;
    float s = (float)sin(th), c = (float)cos(th);
    float* v = x + i * cols + (long long)h * head + head - 2 * npairs + 2 * j;
    float a = v[0], b = v[1];
    v[0] = a * c - b * s;
    v[1] = a * s + b * c;
}

// Interleaved RoPE on the last 2·npairs channels of every `head`-wide slice of each row; the
// angle pos·freq is formed and its sine/cosine taken in double, as the CPU oracle does.
extern "C" __global__ void rope(float* x, const unsigned* rows, int n, const double* freqs, int npairs, int cols,
                                int head, int inverse) {
    pdl_enter();
    GRID_STRIDE(e, (long long)n * (cols / head) * npairs) rope_pair(x, rows, n, freqs, npairs, cols, head, inverse, e);
}

// The norms and rotations of a layer's attention inputs at decode, in one launch where each ran
// its own (`norm_many`; cuda/mod.rs `norms`): q_a's norm with kv's norm + RoPE, then the heads'
// norm + RoPE with the indexer query's RoPE. Job e takes blocks b0 .. next b0: an RMSNorm job
// (nt > 0) one group a block on its first nt threads, the values of `rms_norm` launched with nt
// threads (rms_norm_slice_nt); a RoPE job (nt == 0, in place on out) the pairs of `rope`, spread
// over its blocks. NJ_MAX in cuda/mod.rs too.
#define NJ_MAX 2
struct NormJob {
    float* out;
    signed char* xq;
    float* xd;
    const float* x;
    const float* w;
    float eps;
    int has_w, group, twin, heads, npairs, nt, cols, head, b0;
};
struct NormJobs {
    NormJob j[NJ_MAX];
    int count, blocks;
};

extern "C" __global__ void __launch_bounds__(1024) norm_many(NormJobs jobs, const unsigned* rows, int n,
                                                             const double* freqs) {
    static_assert(NJ_MAX == 2, "the job is chosen by a select, not a runtime index (no local copy)");
    int e = jobs.count > 1 && (int)blockIdx.x >= jobs.j[1].b0;
    const NormJob jb = e ? jobs.j[1] : jobs.j[0];
    if (jb.nt > 0 && jb.has_w && threadIdx.x == 0) WEIGHT_HINT(jb.w, 4LL * jb.group);
    pdl_enter();
    __shared__ float sh[32];
    int bx = blockIdx.x - jb.b0;
    if (jb.nt > 0) {
        long long pos = jb.npairs > 0 ? (long long)ROW_POS(bx / jb.heads) : 0;
        rms_norm_slice_nt(jb.out, jb.xq, jb.xd, jb.x, jb.w, jb.has_w, jb.group, jb.eps, jb.twin,
                          (long long)bx * jb.group, pos, freqs, jb.npairs, sh, jb.nt);
        return;
    }
    int nb = (e == 0 && jobs.count > 1 ? jobs.j[1].b0 : jobs.blocks) - jb.b0;
    long long total = (long long)n * (jb.cols / jb.head) * jb.npairs;
    for (long long i = (long long)bx * blockDim.x + threadIdx.x; i < total; i += (long long)nb * blockDim.x)
        rope_pair(jb.out, rows, n, freqs, jb.npairs, jb.cols, jb.head, 0, i);
}

// rope over a prefill chunk's attention output, with the bf16 copy its wo_a product reads: one
// block a row. The row's npairs angles (shared by every head) are taken once into shared memory,
// then each thread moves 8 values at a time: the rotated pairs go back to x (the same arithmetic
// as `rope`, this file is compiled without contraction) and all 8 into xb rounded to bf16
// (nearest even, cast_bf16's rounding). Needs head and 2·npairs multiples of 8, npairs <= 256,
// cols a multiple of head, x and xb 16-byte aligned.
extern "C" __global__ void __launch_bounds__(256) rope_cast(float* x, unsigned short* xb, const unsigned* rows, int n,
                                                            const double* freqs, int npairs, int cols, int head,
                                                            int inverse) {
    pdl_enter();
    __shared__ float cs[256], sn[256];
    int i = blockIdx.x;
    for (int j = threadIdx.x; j < npairs; j += blockDim.x) {
        double th = (double)ROW_POS(i) * freqs[j];
        if (inverse) th = -th;
        sn[j] = (float)sin(th);
        cs[j] = (float)cos(th);
    }
    __syncthreads();
    float* xr = x + (long long)i * cols;
    uint4* br = (uint4*)(xb + (long long)i * cols);
    int r0 = head - 2 * npairs;
    for (int c = 8 * threadIdx.x; c < cols; c += 8 * blockDim.x) {
        float4 a = *(const float4*)(xr + c), b = *(const float4*)(xr + c + 4);
        float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        int hc = c % head;
        if (hc >= r0) {
            int j0 = (hc - r0) / 2;
#pragma unroll
            for (int u = 0; u < 4; u++) {
                float s = sn[j0 + u], co = cs[j0 + u], p = v[2 * u], q = v[2 * u + 1];
                v[2 * u] = p * co - q * s;
                v[2 * u + 1] = p * s + q * co;
            }
            *(float4*)(xr + c) = make_float4(v[0], v[1], v[2], v[3]);
            *(float4*)(xr + c + 4) = make_float4(v[4], v[5], v[6], v[7]);
        }
        br[c / 8] = make_uint4(bf2(v[0], v[1]), bf2(v[2], v[3]), bf2(v[4], v[5]), bf2(v[6], v[7]));
    }
}

// gemv_f32_block and gemv_route_block: common.cuh.
extern "C" __global__ void gemv_f32(float* out, const float* x, const float* w, int n, int k, int m) {
    if (threadIdx.x == 0 && (int)blockIdx.x < m) WEIGHT_HINT(w + (long long)blockIdx.x * k, 4LL * k);  // the block's row
    pdl_enter();
    __shared__ float sh[32];
    gemv_f32_block(out, x, w, n, k, m, sh);
}

// The router's logits (gemv_f32, one block an expert: grid m) and its choice (moe.cu's `route`,
// a warp a row) in one launch: gemv_route_block (common.cuh). Dynamic shared memory: min(n,
// blockDim / 32)·m floats, a routing warp's scores.
extern "C" __global__ void gemv_route(float* out, const float* x, const float* w, int n, int k, int m, unsigned* cnt,
                                      unsigned* ids, float* wts, const float* bias, const unsigned* hash,
                                      const unsigned* rows, int use_hash, int topk, int norm_topk, float scale) {
    if (threadIdx.x == 0 && (int)blockIdx.x < m) WEIGHT_HINT(w + (long long)blockIdx.x * k, 4LL * k);  // the block's row
    pdl_enter();
    extern __shared__ float sv[];
    gemv_route_block(out, x, w, n, k, m, cnt, ids, wts, bias, hash, rows, use_hash, topk, norm_topk, scale, sv);
}
