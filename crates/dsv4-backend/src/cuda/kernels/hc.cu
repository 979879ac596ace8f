// mHC (spec §4): HC_PRE with Sinkhorn, HC_POST and HC_HEAD. Launchers: cuda/mod.rs.
// The mixing products x·fnᵀ come from cuBLAS (`m`); these kernels apply ρ = 1/rms(x) and the rest.

#define MAX_HC 8

// Sinkhorn normalisation of an n×n matrix after a row softmax, in the oracle's exact order.
// Called by all of warp 0: lane j < n owns row j in the row passes and column j in the column
// passes, each summed and divided in the serial loop's order (so the result is the same), with
// the ~2·iters passes no longer serialised on one thread.
__device__ void sinkhorn_warp(float* c, const float* a, int n, int iters, float eps) {
    int j = threadIdx.x;
    if (j < n) {
        float m = -INFINITY;
        for (int k = 0; k < n; k++) m = fmaxf(m, a[j * n + k]);
        float s = 0.f;
        for (int k = 0; k < n; k++) s += expf(a[j * n + k] - m);
        for (int k = 0; k < n; k++) c[j * n + k] = expf(a[j * n + k] - m) / s + eps;
    }
    __syncwarp();
    for (int it = 0; it < iters; it++) {
        if (it > 0) {
            if (j < n) {
                float s = 0.f;
                for (int k = 0; k < n; k++) s += c[j * n + k];
                s += eps;
                for (int k = 0; k < n; k++) c[j * n + k] /= s;
            }
            __syncwarp();
        }
        if (j < n) {
            float s = 0.f;
            for (int r = 0; r < n; r++) s += c[r * n + j];
            s += eps;
            for (int r = 0; r < n; r++) c[r * n + j] /= s;
        }
        __syncwarp();
    }
}

// ρ = 1/sqrt(mean(x²) + eps) over the whole n·d row.
__device__ float hc_rho(const float* xr, int width, float eps, float* sh) {
    float s = 0.f;
    for (int k = threadIdx.x; k < width; k += blockDim.x) s += xr[k] * xr[k];
    s = block_sum(s, sh);
    return 1.0f / sqrtf(s / (float)width + eps);
}

// One block per row: y = Σ_s pre_s·X_s, post, comb = Sinkhorn(...).
extern "C" __global__ void hc_pre(float* y, float* post, float* comb, const float* x, const float* m,
                                  const float* base, const float* scale, int n, int d, int iters, float rms_eps,
                                  float hc_eps) {
    __shared__ float sh[32];
    __shared__ float pre[MAX_HC];
    __shared__ float a[MAX_HC * MAX_HC];
    __shared__ float cm[MAX_HC * MAX_HC];
    int i = blockIdx.x, mix = (2 + n) * n;
    const float* xr = x + (long long)i * n * d;
    float rho = hc_rho(xr, n * d, rms_eps, sh);
    if (threadIdx.x == 0) {
        const float* mi = m + (long long)i * mix;
        for (int j = 0; j < n; j++) pre[j] = sigmoid_(mi[j] * rho * scale[0] + base[j]) + hc_eps;
        for (int j = 0; j < n; j++) post[i * n + j] = 2.0f * sigmoid_(mi[n + j] * rho * scale[1] + base[n + j]);
        for (int j = 0; j < n * n; j++) a[j] = mi[2 * n + j] * rho * scale[2] + base[2 * n + j];
    }
    __syncthreads();
    // In shared memory (its ~2·iters dependent passes would each wait on global memory).
    if (threadIdx.x < 32) sinkhorn_warp(cm, a, n, iters, hc_eps);
    __syncthreads();
    for (int j = threadIdx.x; j < n * n; j += blockDim.x) comb[(long long)i * n * n + j] = cm[j];
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < n; s++) acc += pre[s] * xr[s * d + c];
        y[(long long)i * d + c] = acc;
    }
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
    if (threadIdx.x == 0)
        for (int s = 0; s < n; s++) pre[s] = sigmoid_(m[(long long)i * n + s] * rho * scale[0] + base[s]) + hc_eps;
    __syncthreads();
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < n; s++) acc += pre[s] * xr[s * d + c];
        y[(long long)i * d + c] = acc;
    }
}
