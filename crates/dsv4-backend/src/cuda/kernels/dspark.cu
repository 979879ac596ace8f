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
