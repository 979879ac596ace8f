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

// out[r] = first index of the maximum of row r (cpu: dspark::argmax). One block per row.
// NaN never wins; a row of NaN gives 0.
extern "C" __global__ void argmax_rows(unsigned* out, const float* x, int cols) {
    pdl_enter();
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* row = x + (long long)blockIdx.x * cols;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    // 16-byte loads, 8 in flight a thread (a lone block per row must not wait on each load).
    int n4 = (cols % 4 == 0 && ((unsigned long long)row & 15) == 0) ? cols / 4 : 0;
    const float4* r4 = (const float4*)row;
#pragma unroll 8
    for (int i = threadIdx.x; i < n4; i += blockDim.x) {
        float4 q = r4[i];
        float e[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int j = 0; j < 4; j++)
            if (e[j] > bv || (e[j] == bv && 4 * i + j < bi)) { bv = e[j]; bi = 4 * i + j; }
    }
    for (int i = 4 * n4 + threadIdx.x; i < cols; i += blockDim.x) {
        float v = row[i];
        if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) { sv[w] = bv; si[w] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 1; k < nw; k++)
            if (sv[k] > bv || (sv[k] == bv && si[k] < bi)) { bv = sv[k]; bi = si[k]; }
        out[blockIdx.x] = bi == 0x7fffffff ? 0 : (unsigned)bi;
    }
}

// Non-causal DSpark block attention (cpu: dspark::grouped_block_attention). q [rows, heads*hd],
// kb [rows, hd]; query row t is in group g = t / qpg, whose keys (K = V) are rows
// slots[off[g]..off[g+1]] of the ring at address rings[g], then the group's qpg rows of kb.
// Sink softmax (the sink only in the denominator), scale hd^-1/2. One block per (row, head);
// dynamic shared memory holds one score per key.
extern "C" __global__ void block_attention(float* out, const float* q, const float* kb,
                                           const unsigned long long* rings, const unsigned* slots,
                                           const unsigned* off, const float* sinks, int heads, int hd,
                                           int qpg) {
    pdl_enter();
    extern __shared__ float sc[];
    __shared__ float den_s;
    int t = blockIdx.x, h = blockIdx.y, g = t / qpg;
    int s0 = off[g], ns = off[g + 1] - s0, nk = ns + qpg;
    const float* ring = (const float*)rings[g];
    const float* qh = q + ((long long)t * heads + h) * hd;
    const float scale = 1.0f / sqrtf((float)hd);
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int j = w; j < nk; j += nw) {
        const float* k = j < ns ? ring + (long long)slots[s0 + j] * hd : kb + ((long long)g * qpg + (j - ns)) * hd;
        float s = 0.f;
        for (int c = lane; c < hd; c += 32) s += qh[c] * k[c];
        s = warp_sum(s);
        if (lane == 0) sc[j] = s * scale;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = sinks[h];
        for (int j = 0; j < nk; j++) m = fmaxf(m, sc[j]);
        float den = expf(sinks[h] - m);
        for (int j = 0; j < nk; j++) {
            sc[j] = expf(sc[j] - m);
            den += sc[j];
        }
        den_s = den;
    }
    __syncthreads();
    float den = den_s;
    for (int c = threadIdx.x; c < hd; c += blockDim.x) {
        float o = 0.f;
        for (int j = 0; j < nk; j++) {
            const float* k = j < ns ? ring + (long long)slots[s0 + j] * hd : kb + ((long long)g * qpg + (j - ns)) * hd;
            o += (sc[j] / den) * k[c];
        }
        out[((long long)t * heads + h) * hd + c] = o;
    }
}
