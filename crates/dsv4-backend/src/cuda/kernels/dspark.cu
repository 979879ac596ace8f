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
