// Shared helpers, prepended to every kernel file before NVRTC compiles it.
#define INFINITY __int_as_float(0x7f800000)

// Row table layout (u32, see CudaRows): six arrays of n entries each.
#define ROW_SEQ(t) rows[(t)]
#define ROW_POS(t) rows[n + (t)]
#define ROW_TOKEN(t) rows[2 * n + (t)]
#define ROW_START(t) rows[3 * n + (t)]   // batch index of the first row of t's segment
#define ROW_POS0(t) rows[4 * n + (t)]    // position of that first row
#define ROW_LEN(t) rows[5 * n + (t)]     // rows in t's segment

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

__device__ __forceinline__ float sigmoid_(float x) { return 1.0f / (1.0f + expf(-x)); }
