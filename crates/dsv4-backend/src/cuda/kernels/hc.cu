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

// One block per row: y = Σ_s pre_s·X_s, post, comb = Sinkhorn(...). The (2 + n)·n mix values
// are formed by one thread each (the same expression per element as one thread in turn).
extern "C" __global__ void hc_pre(float* y, float* post, float* comb, const float* x, const float* m,
                                  const float* base, const float* scale, int n, int d, int iters, float rms_eps,
                                  float hc_eps) {
    __shared__ float sh[32];
    __shared__ float pre[MAX_HC];
    __shared__ float a[MAX_HC * MAX_HC];
    __shared__ float cm[MAX_HC * MAX_HC];
    int i = blockIdx.x, mix = (2 + n) * n, t = threadIdx.x;
    const float* xr = x + (long long)i * n * d;
    float rho = hc_rho(xr, n * d, rms_eps, sh);
    const float* mi = m + (long long)i * mix;
    if (t < n) pre[t] = sigmoid_(mi[t] * rho * scale[0] + base[t]) + hc_eps;
    else if (t < 2 * n) post[i * n + t - n] = 2.0f * sigmoid_(mi[t] * rho * scale[1] + base[t]);
    else if (t < mix) a[t - 2 * n] = mi[t] * rho * scale[2] + base[t];
    __syncthreads();
    // In shared memory (its ~2·iters dependent passes would each wait on global memory).
    if (threadIdx.x < 32) sinkhorn_warp(cm, a, n, iters, hc_eps);
    __syncthreads();
    for (int j = threadIdx.x; j < n * n; j += blockDim.x) comb[(long long)i * n * n + j] = cm[j];
    hc_mix(y + (long long)i * d, xr, pre, n, d);
}

// X'[j] = post[j]·f + Σ_s comb[s][j]·X[s].
extern "C" __global__ void hc_post(float* out, const float* f, const float* x, const float* post, const float* comb,
                                   int rows, int n, int d) {
    GRID_STRIDE(e, (long long)rows * n * d) {
        long long i = e / ((long long)n * d);
        int j = (int)(e / d % n), c = (int)(e % d);
        const float* cr = comb + i * n * n;
        float v = post[i * n + j] * f[i * d + c];
        for (int s = 0; s < n; s++) v += cr[s * n + j] * x[i * n * d + (long long)s * d + c];
        out[e] = v;
    }
}

// HC_HEAD: y = Σ_s (σ(ρ·m_s·scale + base_s) + eps)·X_s, one block per row.
extern "C" __global__ void hc_head(float* y, const float* x, const float* m, const float* base, const float* scale,
                                   int n, int d, float rms_eps, float hc_eps) {
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
