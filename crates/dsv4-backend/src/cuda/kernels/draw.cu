// A step's token choice per output row: greedy argmax, or a seeded draw under temperature,
// top-k, top-p and min-p (cpu twin: draw.rs `draw_row`, which defines the arithmetic; compiled
// with --fmad=false). Weights are integers (units of 2^-46 of the best token's), so every sum
// below is exact in any order: the block's reduction order never changes a token.
//
// draws: DRAW_WORDS u32 a row (temperature, top_k, top_p, min_p as f32 bits, then u's f64 bits,
// low word first), or null: every row greedy. One block of DRAW_THREADS per row. The selects
// find the token at a given position of the best-first order (value, then lowest id) by a radix
// select over the value's order key (12, 12 and 8 bits), counting tokens (top-k) or summing
// weights (top-p, the draw), then the tied tokens in id order.

#define DRAW_THREADS 1024
#define DRAW_WORDS 6
#define DRAW_ONE 70368744177664.0 // 2^46
typedef unsigned long long u64;

__device__ __forceinline__ unsigned draw_key(float v) {
    unsigned b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ u64 draw_weight(float v, float m, double t) {
    return (u64)(exp(((double)v - (double)m) / t) * DRAW_ONE + 0.5);
}

// The kept tokens: two best-first prefixes (key > kc, or key == kc and id <= ic: the whole
// row when kc = 0 and ic = INT_MAX) and a weight floor (0: none).
struct DrawSet {
    unsigned kc, pc;
    int ic, pi;
    u64 floor;
};

__device__ __forceinline__ bool draw_in_prefix(unsigned k, int i, unsigned kc, int ic) {
    return k > kc || (k == kc && i <= ic);
}

// A token's measure in `s` (0: not in it): 1 when counting, else its weight.
__device__ __forceinline__ u64 draw_measure(float v, unsigned k, int i, const DrawSet& s, bool mass, float m, double t) {
    if (!draw_in_prefix(k, i, s.kc, s.ic) || !draw_in_prefix(k, i, s.pc, s.pi)) return 0;
    if (!mass && s.floor == 0) return 1;
    u64 w = draw_weight(v, m, t);
    if (w < s.floor) return 0;
    return mass ? w : 1;
}

// Inclusive block-wide prefix sum of v in thread order; sh[32] then holds the block's total.
// sh: 33 entries of shared memory.
__device__ u64 draw_scan(u64 v, u64* sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads(); // the previous call's readers of sh are done
    for (int o = 1; o < 32; o <<= 1) {
        u64 n = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += n;
    }
    if (lane == 31) sh[w] = v;
    __syncthreads();
    if (w == 0) {
        u64 s = lane < nw ? sh[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            u64 n = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= o) s += n;
        }
        if (lane < nw) sh[lane] = s;
        if (lane == 31) sh[32] = s;
    }
    __syncthreads();
    if (w > 0) v += sh[w - 1];
    return v;
}

// The measure of `s` over the row, on every thread.
__device__ u64 draw_total(const float* row, int cols, const DrawSet& s, float m, double t, u64* sh) {
    u64 acc = 0;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        float v = row[i];
        acc += draw_measure(v, draw_key(v), i, s, true, m, t);
    }
    draw_scan(acc, sh);
    return sh[32];
}

// In id order over the tokens of `s` (with key == key_eq when use_key), the first whose running
// measure reaches `target`; -1 if none does. Each thread walks a contiguous run of ids.
__device__ int draw_find_in_order(const float* row, int cols, const DrawSet& s, bool mass, float m, double t,
                                  bool use_key, unsigned key_eq, u64 target, u64* sh, int* found) {
    int c = (cols + blockDim.x - 1) / blockDim.x;
    int i0 = threadIdx.x * c, i1 = min(cols, i0 + c);
    u64 sum = 0;
    for (int i = i0; i < i1; i++) {
        float v = row[i];
        unsigned k = draw_key(v);
        if (!use_key || k == key_eq) sum += draw_measure(v, k, i, s, mass, m, t);
    }
    if (threadIdx.x == 0) *found = -1;
    u64 incl = draw_scan(sum, sh);
    if (sum > 0 && incl >= target && incl - sum < target) {
        u64 acc = incl - sum;
        for (int i = i0; i < i1; i++) {
            float v = row[i];
            unsigned k = draw_key(v);
            if (use_key && k != key_eq) continue;
            acc += draw_measure(v, k, i, s, mass, m, t);
            if (acc >= target) {
                *found = i;
                break;
            }
        }
    }
    __syncthreads();
    int r = *found;
    __syncthreads();
    return r;
}

// The token at the best-first position of `s` where the running measure reaches `target`
// (1 <= target <= the measure of s): its key in *key, its id returned (-1: none, a bug).
__device__ int draw_select(const float* row, int cols, const DrawSet& s, bool mass, float m, double t, u64 target,
                           u64* hist, u64* sh, int* found, u64* above, unsigned* key) {
    unsigned prefix = 0, pmask = 0;
    const int shifts[3] = {20, 8, 0}, widths[3] = {12, 12, 8};
    for (int pass = 0; pass < 3; pass++) {
        int shift = shifts[pass], nb = 1 << widths[pass];
        for (int b = threadIdx.x; b < nb; b += blockDim.x) hist[b] = 0;
        if (threadIdx.x == 0) *found = -1;
        __syncthreads();
        for (int i = threadIdx.x; i < cols; i += blockDim.x) {
            float v = row[i];
            unsigned k = draw_key(v);
            if ((k & pmask) != prefix) continue;
            u64 x = draw_measure(v, k, i, s, mass, m, t);
            if (x) atomicAdd(&hist[(k >> shift) & (nb - 1)], x);
        }
        // Bins best first: thread j holds bins [nb - (j+1)c, nb - jc), c = nb / threads (>= 1).
        int c = max(1, nb / (int)blockDim.x);
        int lo = nb - ((int)threadIdx.x + 1) * c;
        __syncthreads();
        u64 sum = 0;
        if (lo >= 0)
            for (int q = 0; q < c; q++) sum += hist[lo + q];
        u64 incl = draw_scan(sum, sh);
        if (lo >= 0 && sum > 0 && incl >= target && incl - sum < target) {
            u64 acc = incl - sum;
            for (int q = c - 1; q >= 0; q--) {
                u64 h = hist[lo + q];
                if (acc + h >= target) {
                    *found = lo + q;
                    *above = acc;
                    break;
                }
                acc += h;
            }
        }
        __syncthreads();
        int d = *found;
        u64 a = *above;
        __syncthreads();
        if (d < 0) return -1;
        prefix |= (unsigned)d << shift;
        pmask |= (unsigned)(nb - 1) << shift;
        target -= a;
    }
    *key = prefix;
    return draw_find_in_order(row, cols, s, mass, m, t, true, prefix, target, sh, found);
}

// The draw's position in a kept mass (draw.rs `target`).
__device__ __forceinline__ u64 draw_target(double u, u64 mass) {
    u64 r = (u64)floor(u * (double)mass) + 1;
    return r < mass ? r : mass;
}

// out[r] = row r's token (draw.rs draw_row): the first index of the maximum when greedy (NaN
// never wins; a row of NaN gives 0), else the seeded draw.
extern "C" __global__ void __launch_bounds__(DRAW_THREADS) draw_rows(unsigned* out, const float* x,
                                                                   const unsigned* draws, int cols) {
    pdl_enter();
    __shared__ u64 hist[4096];
    __shared__ u64 sh[33];
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ int found;
    __shared__ u64 above;
    __shared__ unsigned skey;
    const float* row = x + (long long)blockIdx.x * cols;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    // The argmax, with 16-byte loads, 8 in flight a thread.
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
        sv[0] = bv;
        si[0] = bi == 0x7fffffff ? 0 : bi;
    }
    __syncthreads();
    bv = sv[0];
    int best = si[0];
    const unsigned* p = draws ? draws + (long long)blockIdx.x * DRAW_WORDS : 0;
    float temp = p ? __uint_as_float(p[0]) : 0.0f;
    if (!(temp > 0.0f) || !isfinite(bv)) {
        if (threadIdx.x == 0) out[blockIdx.x] = (unsigned)best;
        return;
    }
    unsigned top_k = p[1];
    float top_p = __uint_as_float(p[2]), min_p = __uint_as_float(p[3]);
    double u = __hiloint2double((int)p[5], (int)p[4]);
    double t = (double)temp;
    DrawSet s = {0u, 0u, 0x7fffffff, 0x7fffffff, 0ull};
    int tok;
    if (top_k == 0 && !(top_p < 1.0f) && !(min_p > 0.0f)) {
        // No filter: the draw walks the whole row in id order.
        u64 total = draw_total(row, cols, s, bv, t, sh);
        tok = draw_find_in_order(row, cols, s, true, bv, t, false, 0, draw_target(u, total), sh, &found);
    } else {
        tok = 0;
        if (top_k > 0 && top_k < (unsigned)cols) {
            int id = draw_select(row, cols, s, false, bv, t, top_k, hist, sh, &found, &above, &skey);
            s.kc = skey;
            s.ic = id;
            tok = id < 0 ? -1 : 0;
        }
        if (tok >= 0 && top_p < 1.0f) {
            u64 total = draw_total(row, cols, s, bv, t, sh);
            u64 cut = (u64)ceil((double)top_p * (double)total);
            int id = draw_select(row, cols, s, true, bv, t, cut, hist, sh, &found, &above, &skey);
            s.pc = skey;
            s.pi = id;
            tok = id < 0 ? -1 : 0;
        }
        if (tok >= 0) {
            s.floor = min_p > 0.0f ? (u64)ceil((double)min_p * DRAW_ONE) : 0ull;
            u64 mass = draw_total(row, cols, s, bv, t, sh);
            tok = draw_select(row, cols, s, true, bv, t, draw_target(u, mass), hist, sh, &found, &above, &skey);
        }
    }
    if (threadIdx.x == 0) out[blockIdx.x] = (unsigned)(tok < 0 ? best : tok);
}
