// Router (spec §6.1) and the routed experts. Launchers: cuda/moe.rs.
// Experts are applied per (row, slot) with one warp per output element, reading each slot's
// expert weights through a device table of pointers: three launches for any batch, no host sync.

// One warp per row (blocks of 32 threads, one row each): route_row (common.cuh).
extern "C" __global__ void route(unsigned* ids, float* wts, const float* logits, const float* bias,
                                 const unsigned* hash, const unsigned* rows, int use_hash, int n, int e, int k,
                                 int norm_topk, float scale) {
    pdl_enter();
    __shared__ float sv[1024];
    __shared__ unsigned ch[MAX_K];
    int i = blockIdx.x;
    if (i >= n) return;
    route_row(ids, wts, logits, bias, hash, rows, use_hash, n, e, k, norm_topk, scale, i, sv, ch);
}

__device__ __forceinline__ float warp_dot(const float* a, const float* b, int len, int lane) {
    float s = 0.f;
    for (int c = lane; c < len; c += 32) s += a[c] * b[c];
    return warp_sum(s);
}

// h[slot, o] = act(w1[e][o]·x, w3[e][o]·x) for slot = row·k + j, e = ids[slot]. grid (slots, ⌈inter/8⌉).
// ptrs holds 3·E device pointers: w1 of every expert, then w3, then w2.
extern "C" __global__ void moe_up(float* hbuf, const float* x, const unsigned* ids, const unsigned long long* ptrs,
                                  int nexp, int k, int d, int inter, float limit) {
    pdl_enter();
    int slot = blockIdx.x, lane = threadIdx.x & 31;
    int o = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (o >= inter) return;
    unsigned e = ids[slot];
    const float* w1 = (const float*)ptrs[e] + (long long)o * d;
    const float* w3 = (const float*)ptrs[nexp + e] + (long long)o * d;
    const float* xr = x + (long long)(slot / k) * d;
    float g = warp_dot(xr, w1, d, lane), u = warp_dot(xr, w3, d, lane);
    if (lane == 0) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
        hbuf[(long long)slot * inter + o] = g * sigmoid_(g) * u;
    }
}

// y[slot, c] = w2[e][c]·h[slot]. grid (slots, ⌈d/8⌉).
extern "C" __global__ void moe_down(float* y, const float* hbuf, const unsigned* ids, const unsigned long long* ptrs,
                                    int nexp, int d, int inter) {
    pdl_enter();
    int slot = blockIdx.x, lane = threadIdx.x & 31;
    int c = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (c >= d) return;
    const float* w2 = (const float*)ptrs[2 * nexp + ids[slot]] + (long long)c * inter;
    float v = warp_dot(hbuf + (long long)slot * inter, w2, inter, lane);
    if (lane == 0) y[(long long)slot * d + c] = v;
}

// out[r, c] = Σ_j wts[r, j]·y[r·k + j, c], in routing order.
extern "C" __global__ void moe_combine(float* out, const float* y, const float* wts, int n, int k, int d) {
    pdl_enter();
    GRID_STRIDE(e, (long long)n * d) {
        long long r = e / d, c = e % d;
        float acc = 0.f;
        for (int j = 0; j < k; j++) acc += wts[r * k + j] * y[(r * k + j) * d + c];
        out[e] = acc;
    }
}
