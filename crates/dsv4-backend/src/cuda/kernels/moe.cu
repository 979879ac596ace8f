// Router (spec §6.1) and the routed experts. Launchers: cuda/moe.rs.
// Experts are applied per (row, slot) with one warp per output element, reading each slot's
// expert weights through a device table of pointers: three launches for any batch, no host sync.

#define MAX_K 16

__device__ __forceinline__ float sqrt_softplus(float z) {
    float sp = z > 20.0f ? z : log1pf(expf(z));
    return sqrtf(sp);
}

// One warp per row (blocks of 32 threads, one row each). Hash layers take their ids from the
// `tid2eid` table `hash` [vocab, k] at the row's token (from the row table `rows`); learned layers take the top k of score + bias (ties to the lower expert id), in
// descending order: each lane scores its experts once, then k rounds of warp argmax.
extern "C" __global__ void route(unsigned* ids, float* wts, const float* logits, const float* bias,
                                 const unsigned* hash, const unsigned* rows, int use_hash, int n, int e, int k,
                                 int norm_topk,
                                 float scale) {
    pdl_enter();
    __shared__ float sv[1024];
    __shared__ unsigned ch[MAX_K];
    int i = blockIdx.x, lane = threadIdx.x;
    if (i >= n) return;
    const float* z = logits + (long long)i * e;
    if (use_hash) {
        if (lane < k) ch[lane] = hash[(long long)ROW_TOKEN(i) * k + lane];
    } else {
        for (int c = lane; c < e; c += 32) sv[c] = sqrt_softplus(z[c]) + bias[c];
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
    float sj = lane < k ? sqrt_softplus(z[cj]) : 0.f;
    float sum = 0.f;
    for (int j = 0; j < k; j++) sum += __shfl_sync(0xffffffffu, sj, j);
    if (lane < k) {
        float w = norm_topk ? sj / sum : sj;
        ids[(long long)i * k + lane] = cj;
        wts[(long long)i * k + lane] = w * scale;
    }
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
