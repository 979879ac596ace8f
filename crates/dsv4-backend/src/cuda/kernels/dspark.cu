// DSpark drafter kernels (spec dspark.md §3.3-§3.6). Each is the twin of a CPU reference in
// cpu/dspark.rs (named alike); compiled with --fmad=false like the other f32 kernels.

// dst[idx[i], :] = src[i, :] (context-ring writes; cpu: CpuBackend::scatter_rows).
extern "C" __global__ void scatter_rows(float* dst, const float* src, const unsigned* idx, int n, int cols) {
    pdl_enter();
    GRID_STRIDE(e, (long long)n * cols) {
        long long i = e / cols, c = e % cols;
        dst[(long long)idx[i] * cols + c] = src[e];
    }
}

// Non-causal DSpark block attention (cpu: dspark::grouped_block_attention). q [rows, heads*hd],
// kb [rows, hd]; query row t is in group g = t / qpg, whose keys (K = V) are rows
// slots[off[g]..off[g+1]] of the ring at address rings[g], then the group's qpg rows of kb.
// Sink softmax (the sink only in the denominator), scale hd^-1/2. One block per (row, head);
// dynamic shared memory holds each key's address and score (12 bytes a key). The scores take a
// warp per four keys (their loads in flight together), the softmax the whole block, and the
// output four adjacent columns a thread with eight keys' loads in flight; each output column
// still adds its keys in key order, as the CPU does. (The first form summed the softmax in one
// thread and waited one L2 trip per key and column: ~185 us a stage at gamma = 5, 64 heads,
// 133 keys of 512.)
#define BA_KEYS 4
#define BA_OUT 8
extern "C" __global__ void block_attention(float* out, const float* __restrict__ q, const float* __restrict__ kb,
                                           const unsigned long long* rings, const unsigned* slots,
                                           const unsigned* off, const float* sinks, int heads, int hd,
                                           int qpg) {
    pdl_enter();
    extern __shared__ unsigned long long ba_dyn[];
    __shared__ float red[32];
    int t = blockIdx.x, h = blockIdx.y, g = t / qpg;
    int s0 = off[g], ns = off[g + 1] - s0, nk = ns + qpg;
    const float** kp = (const float**)ba_dyn;
    float* sc = (float*)(ba_dyn + nk);
    const float* ring = (const float*)rings[g];
    for (int j = threadIdx.x; j < nk; j += blockDim.x)
        kp[j] = j < ns ? ring + (long long)slots[s0 + j] * hd : kb + ((long long)g * qpg + (j - ns)) * hd;
    __syncthreads();
    const float* qh = q + ((long long)t * heads + h) * hd;
    const float scale = 1.0f / sqrtf((float)hd);
    const bool v4 = (hd & 3) == 0;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int j0 = w * BA_KEYS; j0 < nk; j0 += nw * BA_KEYS) {
        const float* k[BA_KEYS];
#pragma unroll
        for (int u = 0; u < BA_KEYS; u++) k[u] = kp[min(j0 + u, nk - 1)];
        float s[BA_KEYS] = {};
        if (v4) {
            for (int c = lane * 4; c < hd; c += 128) {
                float4 qv = *(const float4*)(qh + c);
                float4 kv[BA_KEYS];
#pragma unroll
                for (int u = 0; u < BA_KEYS; u++) kv[u] = *(const float4*)(k[u] + c);
#pragma unroll
                for (int u = 0; u < BA_KEYS; u++)
                    s[u] += qv.x * kv[u].x + qv.y * kv[u].y + qv.z * kv[u].z + qv.w * kv[u].w;
            }
        } else {
            for (int c = lane; c < hd; c += 32) {
                float qv = qh[c];
#pragma unroll
                for (int u = 0; u < BA_KEYS; u++) s[u] += qv * k[u][c];
            }
        }
#pragma unroll
        for (int u = 0; u < BA_KEYS; u++) {
            float v = warp_sum(s[u]);
            if (lane == 0 && j0 + u < nk) sc[j0 + u] = v * scale;
        }
    }
    __syncthreads();
    float m = -INFINITY;
    for (int j = threadIdx.x; j < nk; j += blockDim.x) m = fmaxf(m, sc[j]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) red[w] = m;
    __syncthreads();
    m = sinks[h];
    for (int i = 0; i < nw; i++) m = fmaxf(m, red[i]);
    float part = 0.f;
    for (int j = threadIdx.x; j < nk; j += blockDim.x) {
        float e = expf(sc[j] - m);
        sc[j] = e;
        part += e;
    }
    float den = block_sum(part, red) + expf(sinks[h] - m);
    for (int j = threadIdx.x; j < nk; j += blockDim.x) sc[j] = sc[j] / den;
    __syncthreads();
    float* oh = out + ((long long)t * heads + h) * hd;
    if (v4) {
        for (int c = threadIdx.x * 4; c < hd; c += blockDim.x * 4) {
            float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
            int j = 0;
            for (; j + BA_OUT <= nk; j += BA_OUT) {
                float4 kv[BA_OUT];
#pragma unroll
                for (int u = 0; u < BA_OUT; u++) kv[u] = *(const float4*)(kp[j + u] + c);
#pragma unroll
                for (int u = 0; u < BA_OUT; u++) {
                    float p = sc[j + u];
                    o.x += p * kv[u].x;
                    o.y += p * kv[u].y;
                    o.z += p * kv[u].z;
                    o.w += p * kv[u].w;
                }
            }
            for (; j < nk; j++) {
                float4 kv = *(const float4*)(kp[j] + c);
                float p = sc[j];
                o.x += p * kv.x;
                o.y += p * kv.y;
                o.z += p * kv.z;
                o.w += p * kv.w;
            }
            *(float4*)(oh + c) = o;
        }
    } else {
        for (int c = threadIdx.x; c < hd; c += blockDim.x) {
            float o = 0.f;
            for (int j = 0; j < nk; j++) o += sc[j] * kp[j][c];
            oh[c] = o;
        }
    }
}

// block_attention for hd = 512 on blocks of BAH heads of one row: each key's 2 KB is read once
// for BAH heads instead of once a head. block_attention's (row, head) blocks read every key
// twice a head from L2, 170 MB a stage at gamma = 5, 64 heads and 133 keys: ~35 us a launch
// bound by L2 (PERF.md v53). The values are block_attention's bit for bit: each score is a warp
// over the columns 4·lane + 128·i with the same expression and butterfly, and each head's softmax
// sum is formed by 128 threads (a half of the block) over keys tt, tt + 128, ... and added over
// its four warps in order, as block_sum of the 128-thread block; each output column adds its keys
// in key order. 256 threads: warp w takes keys w, w + 8, ...; thread i forms columns 2i, 2i + 1
// of all BAH heads.
#define BAH 4
extern "C" __global__ void __launch_bounds__(256) block_attention_h(float* out, const float* __restrict__ q,
                                                                  const float* __restrict__ kb,
                                                                  const unsigned long long* rings,
                                                                  const unsigned* slots, const unsigned* off,
                                                                  const float* sinks, int heads, int hd_arg,
                                                                  int qpg) {
    const int hd = 512;  // hd_arg: block_attention's parameter, 512 here (the launcher checks)
    pdl_enter();
    extern __shared__ unsigned long long ba_dyn[];
    __shared__ float red[BAH][4];
    int t = blockIdx.x, h0 = blockIdx.y * BAH, g = t / qpg;
    int s0 = off[g], ns = off[g + 1] - s0, nk = ns + qpg;
    const float** kp = (const float**)ba_dyn;
    float* sc = (float*)(ba_dyn + nk);  // [BAH][nk]
    const float* ring = (const float*)rings[g];
    for (int j = threadIdx.x; j < nk; j += blockDim.x)
        kp[j] = j < ns ? ring + (long long)slots[s0 + j] * hd : kb + ((long long)g * qpg + (j - ns)) * hd;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    // The lane's query columns 4·lane + 128·i of each head.
    float4 qv[BAH][4];
#pragma unroll
    for (int hh = 0; hh < BAH; hh++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            qv[hh][i] = *(const float4*)(q + ((long long)t * heads + h0 + hh) * hd + lane * 4 + 128 * i);
    __syncthreads();
    const float scale = 1.0f / sqrtf((float)hd);
    for (int j = w; j < nk; j += 8) {
        const float* k = kp[j];
        float4 kv[4];
#pragma unroll
        for (int i = 0; i < 4; i++) kv[i] = *(const float4*)(k + lane * 4 + 128 * i);
        float s[BAH];
#pragma unroll
        for (int hh = 0; hh < BAH; hh++) {
            s[hh] = 0.f;
#pragma unroll
            for (int i = 0; i < 4; i++)
                s[hh] += qv[hh][i].x * kv[i].x + qv[hh][i].y * kv[i].y + qv[hh][i].z * kv[i].z + qv[hh][i].w * kv[i].w;
        }
#pragma unroll
        for (int hh = 0; hh < BAH; hh++) {
            float v = warp_sum(s[hh]);
            if (lane == 0) sc[hh * nk + j] = v * scale;
        }
    }
    __syncthreads();
    // Heads half, half + 2, ... on the block's half `half` (threads tt = 0..127 of it).
    int half = threadIdx.x >> 7, tt = threadIdx.x & 127, hw = tt >> 5;
    float mh[BAH / 2];
#pragma unroll
    for (int p = 0; p < BAH / 2; p++) {
        int hh = half + 2 * p;
        float m = -INFINITY;
        for (int j = tt; j < nk; j += 128) m = fmaxf(m, sc[hh * nk + j]);
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (lane == 0) red[hh][hw] = m;
    }
    __syncthreads();
#pragma unroll
    for (int p = 0; p < BAH / 2; p++) {
        int hh = half + 2 * p;
        float m = sinks[h0 + hh];
        for (int i = 0; i < 4; i++) m = fmaxf(m, red[hh][i]);
        mh[p] = m;
    }
    __syncthreads();
#pragma unroll
    for (int p = 0; p < BAH / 2; p++) {
        int hh = half + 2 * p;
        float part = 0.f;
        for (int j = tt; j < nk; j += 128) {
            float e = expf(sc[hh * nk + j] - mh[p]);
            sc[hh * nk + j] = e;
            part += e;
        }
        part = warp_sum(part);
        if (lane == 0) red[hh][hw] = part;
    }
    __syncthreads();
#pragma unroll
    for (int p = 0; p < BAH / 2; p++) {
        int hh = half + 2 * p;
        float den = 0.f;
        for (int i = 0; i < 4; i++) den += red[hh][i];
        den = den + expf(sinks[h0 + hh] - mh[p]);
        for (int j = tt; j < nk; j += 128) sc[hh * nk + j] = sc[hh * nk + j] / den;
    }
    __syncthreads();
    int c = 2 * threadIdx.x;
    float2 o[BAH];
#pragma unroll
    for (int hh = 0; hh < BAH; hh++) o[hh] = make_float2(0.f, 0.f);
    int j = 0;
    for (; j + BA_OUT <= nk; j += BA_OUT) {
        float2 kv[BA_OUT];
#pragma unroll
        for (int u = 0; u < BA_OUT; u++) kv[u] = *(const float2*)(kp[j + u] + c);
#pragma unroll
        for (int u = 0; u < BA_OUT; u++)
#pragma unroll
            for (int hh = 0; hh < BAH; hh++) {
                float p = sc[hh * nk + j + u];
                o[hh].x += p * kv[u].x;
                o[hh].y += p * kv[u].y;
            }
    }
    for (; j < nk; j++) {
        float2 kv = *(const float2*)(kp[j] + c);
#pragma unroll
        for (int hh = 0; hh < BAH; hh++) {
            float p = sc[hh * nk + j];
            o[hh].x += p * kv.x;
            o[hh].y += p * kv.y;
        }
    }
#pragma unroll
    for (int hh = 0; hh < BAH; hh++) *(float2*)(out + ((long long)t * heads + h0 + hh) * hd + c) = o[hh];
}

// The drafter's greedy Markov slot (dspark.md §3.6) in one launch, for n ≤ 16 sequences:
// ids[i] = the first index of the maximum over v < V of
//   z[i][v] = u[(u0 + i·ustep)·V + v] + Σ_c markov_w2[v][c] · w1[prev[i]][c],
// NaN never winning and a row of NaN giving 0. Fast mode's separate ops (select_rows, embed_ids,
// the bf16 product on gemvt_bf16's tiles, add, draw_rows' greedy argmax: five launches and four
// [n, V] buffers a slot, PERF.md v53) give the same ids: the bias is gemvt_bf16's value bit for
// bit (a tile of 16 outputs, lane (g, t) holding values 8t..8t+7 of each k32 block, warp w the
// blocks w, w + 8, ... in order, the activations rounded to bf16 by the same cvt, the 8 warps'
// sums added in warp order), z is the same f32 add, and the argmax the same total order (larger
// value, then smaller index), so the order of the search does not matter. Block b takes the
// tiles b, b + gridDim.x, ...; its per-row best goes to part, and the last block to finish
// (a ticket in `counter`, left zero) picks each row's best over the blocks.
// w1 is f32 (w1f) or bf16 (w1b, the other null). r a multiple of 32, at most 256·MK_KB.
#define MK_KB 2
extern "C" __global__ void __launch_bounds__(256) markov_argmax(unsigned* ids, float* part_v, int* part_i,
                                                              unsigned* counter, const float* __restrict__ u, int ustep,
                                                              int u0, const unsigned* prev, const float* w1f,
                                                              const unsigned short* w1b,
                                                              const unsigned short* __restrict__ w2, int n, int r,
                                                              int V) {
    pdl_enter();
    __shared__ float part[8][16][17];
    __shared__ float bv_s[16][16];
    __shared__ int bi_s[16][16];
    __shared__ bool last;
    int wp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    // The activation rows of mma columns g and g + 8 (rows past n repeat the last; not used).
    long long ra = (long long)prev[min(g, n - 1)] * r + 8 * t, rb = (long long)prev[min(g + 8, n - 1)] * r + 8 * t;
    bool two = n > 8;
    // The B fragments of the warp's k blocks (the same every tile).
    unsigned xa[MK_KB][4], xb[MK_KB][4];
#pragma unroll
    for (int q = 0; q < MK_KB; q++) {
        int kb = 32 * wp + 256 * q;
        float x[8], y[8];
#pragma unroll
        for (int e = 0; e < 8; e++) {
            bool in = kb < r;
            x[e] = !in ? 0.f : w1b ? __uint_as_float((unsigned)w1b[ra + kb + e] << 16) : w1f[ra + kb + e];
            y[e] = !in || !two ? 0.f : w1b ? __uint_as_float((unsigned)w1b[rb + kb + e] << 16) : w1f[rb + kb + e];
        }
#pragma unroll
        for (int e = 0; e < 4; e++) {
            xa[q][e] = bf2(x[2 * e], x[2 * e + 1]);
            xb[q][e] = bf2(y[2 * e], y[2 * e + 1]);
        }
    }
    int oo = threadIdx.x >> 4, rr = threadIdx.x & 15;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    int tiles = (V + 15) / 16;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        int o0 = tile * 16;
        const unsigned short* wa = w2 + (long long)min(o0 + g, V - 1) * r + 8 * t;
        const unsigned short* wb = w2 + (long long)min(o0 + g + 8, V - 1) * r + 8 * t;
        float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int q = 0; q < MK_KB; q++) {
            int kb = 32 * wp + 256 * q;
            if (kb >= r) break;
            uint4 a = *(const uint4*)(wa + kb), b = *(const uint4*)(wb + kb);
            unsigned fa[4] = {a.x, b.x, a.y, b.y}, fb[4] = {a.z, b.z, a.w, b.w};
            mma_bf16_16816(d0, fa, xa[q][0], xa[q][1]);
            mma_bf16_16816(d0, fb, xa[q][2], xa[q][3]);
            if (two) {
                mma_bf16_16816(d1, fa, xb[q][0], xb[q][1]);
                mma_bf16_16816(d1, fb, xb[q][2], xb[q][3]);
            }
        }
        mma_tile_part(part[wp], d0, d1, g, t);
        __syncthreads();
        int o = o0 + oo;
        if (o < V && rr < n) {
            float v = part[0][oo][rr];
#pragma unroll
            for (int i = 1; i < 8; i++) v += part[i][oo][rr];
            float z = u[((long long)rr * ustep + u0) * V + o] + v;
            if (z > bv || (z == bv && o < bi)) { bv = z; bi = o; }
        }
        __syncthreads();
    }
    bv_s[oo][rr] = bv;
    bi_s[oo][rr] = bi;
    __syncthreads();
    if (threadIdx.x < 16) {
        for (int i = 1; i < 16; i++) {
            float v = bv_s[i][rr];
            int x = bi_s[i][rr];
            if (v > bv || (v == bv && x < bi)) { bv = v; bi = x; }
        }
        part_v[blockIdx.x * 16 + rr] = bv;
        part_i[blockIdx.x * 16 + rr] = bi;
        __threadfence();
    }
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    // The last block: thread (s, row) takes blocks s, s + 16, ...; then row's 16 in order.
    bv = -INFINITY;
    bi = 0x7fffffff;
    for (int b = oo; b < gridDim.x; b += 16) {
        float v = __ldcg(part_v + b * 16 + rr);
        int x = __ldcg(part_i + b * 16 + rr);
        if (v > bv || (v == bv && x < bi)) { bv = v; bi = x; }
    }
    bv_s[oo][rr] = bv;
    bi_s[oo][rr] = bi;
    __syncthreads();
    if (threadIdx.x < n) {
        for (int i = 1; i < 16; i++) {
            float v = bv_s[i][rr];
            int x = bi_s[i][rr];
            if (v > bv || (v == bv && x < bi)) { bv = v; bi = x; }
        }
        ids[rr] = bi == 0x7fffffff ? 0u : (unsigned)bi;
    }
    if (threadIdx.x == 0) *counter = 0u;
}
