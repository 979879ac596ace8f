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
// Histogram bins a radix pass (11, 11 and 10 bits of the order key), and a weight's 12-bit limbs
// (48 bits hold 2^46): each limb of a bin sums in a u32 below 2^32 for up to 2^20 tokens (the
// host checks the width), so the passes use the native 32-bit shared atomics, not a 64-bit
// compare-and-swap loop (1.8x slower a top-p draw on the H100, where many tokens share a bin).
#define DRAW_BINS 2048
#define DRAW_LIMBS 4
typedef unsigned long long u64;

__device__ __forceinline__ unsigned draw_key(float v) {
    unsigned b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// exp((v - m) / t) in units of 2^-46 (inv_t = 1 / t): below -33 the rounding gives 0 anyway,
// so the exp is skipped there.
__device__ __forceinline__ u64 draw_weight(float v, float m, double inv_t) {
    double x = ((double)v - (double)m) * inv_t;
    if (x < -33.0) return 0;
    return (u64)(exp(x) * DRAW_ONE + 0.5);
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
__device__ __forceinline__ u64 draw_measure(float v, unsigned k, int i, const DrawSet& s, bool mass, float m,
                                            double inv_t) {
    if (!draw_in_prefix(k, i, s.kc, s.ic) || !draw_in_prefix(k, i, s.pc, s.pi)) return 0;
    if (!mass && s.floor == 0) return 1;
    u64 w = draw_weight(v, m, inv_t);
    if (w < s.floor) return 0;
    return mass ? w : 1;
}

// Where a select stops, given the total measure of its set: a fixed position (top-k), the
// first position whose running mass reaches top_p of the total (draw.rs: ceil), or the draw's
// (draw.rs `target`).
struct DrawTarget {
    int mode; // 0 fixed, 1 top-p, 2 draw
    u64 fixed;
    double x;
};

__device__ __forceinline__ u64 draw_resolve(const DrawTarget& t, u64 total) {
    if (t.mode == 0) return t.fixed;
    if (t.mode == 1) return (u64)ceil(t.x * (double)total);
    u64 r = (u64)floor(t.x * (double)total) + 1;
    return r < total ? r : total;
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

// In id order over the tokens of `s` (with key == key_eq when use_key), the first whose running
// measure reaches the target (resolved on the set's total); -1 if none does. Each thread walks
// a contiguous run of ids.
__device__ int draw_find_in_order(const float* row, int cols, const DrawSet& s, bool mass, float m, double inv_t,
                                  bool use_key, unsigned key_eq, DrawTarget tg, u64* sh, int* found) {
    int c = (cols + blockDim.x - 1) / blockDim.x;
    int i0 = threadIdx.x * c, i1 = min(cols, i0 + c);
    u64 sum = 0;
    for (int i = i0; i < i1; i++) {
        float v = row[i];
        unsigned k = draw_key(v);
        if (!use_key || k == key_eq) sum += draw_measure(v, k, i, s, mass, m, inv_t);
    }
    if (threadIdx.x == 0) *found = -1;
    u64 incl = draw_scan(sum, sh);
    u64 target = draw_resolve(tg, sh[32]);
    if (sum > 0 && incl >= target && incl - sum < target) {
        u64 acc = incl - sum;
        for (int i = i0; i < i1; i++) {
            float v = row[i];
            unsigned k = draw_key(v);
            if (use_key && k != key_eq) continue;
            acc += draw_measure(v, k, i, s, mass, m, inv_t);
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

// The token at the best-first position of `s` where the running measure reaches the target
// (resolved on the set's total, the first pass's sum): its key in *key, its id returned (-1:
// none, a bug).
__device__ int draw_select(const float* row, int cols, const DrawSet& s, bool mass, float m, double inv_t,
                           DrawTarget tg, unsigned (*hist)[DRAW_BINS], u64* sh, int* found, u64* above,
                           unsigned* key) {
    unsigned prefix = 0, pmask = 0;
    const int shifts[3] = {21, 10, 0}, widths[3] = {11, 11, 10};
    u64 target = 0;
    for (int pass = 0; pass < 3; pass++) {
        int shift = shifts[pass], nb = 1 << widths[pass];
        for (int b = threadIdx.x; b < nb; b += blockDim.x)
            for (int j = 0; j < DRAW_LIMBS; j++) hist[j][b] = 0;
        if (threadIdx.x == 0) *found = -1;
        __syncthreads();
        for (int i = threadIdx.x; i < cols; i += blockDim.x) {
            float v = row[i];
            unsigned k = draw_key(v);
            if ((k & pmask) != prefix) continue;
            u64 x = draw_measure(v, k, i, s, mass, m, inv_t);
            unsigned b = (k >> shift) & (nb - 1);
            for (int j = 0; j < DRAW_LIMBS && x; j++, x >>= 12)
                if (x & 0xfff) atomicAdd(&hist[j][b], (unsigned)(x & 0xfff));
        }
        // Bins best first: thread j holds bins [nb - (j+1)c, nb - jc), c = nb / threads (>= 1).
        int c = max(1, nb / (int)blockDim.x);
        int lo = nb - ((int)threadIdx.x + 1) * c;
        __syncthreads();
        u64 sum = 0;
        if (lo >= 0)
            for (int q = 0; q < c; q++)
                for (int j = 0; j < DRAW_LIMBS; j++) sum += (u64)hist[j][lo + q] << (12 * j);
        u64 incl = draw_scan(sum, sh);
        if (pass == 0) target = draw_resolve(tg, sh[32]);
        if (lo >= 0 && sum > 0 && incl >= target && incl - sum < target) {
            u64 acc = incl - sum;
            for (int q = c - 1; q >= 0; q--) {
                u64 h = 0;
                for (int j = 0; j < DRAW_LIMBS; j++) h += (u64)hist[j][lo + q] << (12 * j);
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
    DrawTarget rest = {0, target, 0.0};
    return draw_find_in_order(row, cols, s, mass, m, inv_t, true, prefix, rest, sh, found);
}

// out[r] = row r's token (draw.rs draw_row): the first index of the maximum when greedy (NaN
// never wins; a row of NaN gives 0), else the seeded draw.
extern "C" __global__ void __launch_bounds__(DRAW_THREADS) draw_rows(unsigned* out, const float* x,
                                                                   const unsigned* draws, int cols) {
    pdl_enter();
    __shared__ unsigned hist[DRAW_LIMBS][DRAW_BINS];
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
    double inv_t = 1.0 / (double)temp;
    DrawSet s = {0u, 0u, 0x7fffffff, 0x7fffffff, 0ull};
    DrawTarget draw = {2, 0, u};
    int tok;
    if (top_k == 0 && !(top_p < 1.0f) && !(min_p > 0.0f)) {
        // No filter: the draw walks the whole row in id order.
        tok = draw_find_in_order(row, cols, s, true, bv, inv_t, false, 0, draw, sh, &found);
    } else {
        tok = 0;
        if (top_k > 0 && top_k < (unsigned)cols) {
            DrawTarget k = {0, top_k, 0.0};
            int id = draw_select(row, cols, s, false, bv, inv_t, k, hist, sh, &found, &above, &skey);
            s.kc = skey;
            s.ic = id;
            tok = id < 0 ? -1 : 0;
        }
        if (tok >= 0 && top_p < 1.0f) {
            DrawTarget cut = {1, 0, (double)top_p};
            int id = draw_select(row, cols, s, true, bv, inv_t, cut, hist, sh, &found, &above, &skey);
            s.pc = skey;
            s.pi = id;
            tok = id < 0 ? -1 : 0;
        }
        if (tok >= 0) {
            s.floor = min_p > 0.0f ? (u64)ceil((double)min_p * DRAW_ONE) : 0ull;
            tok = draw_select(row, cols, s, true, bv, inv_t, draw, hist, sh, &found, &above, &skey);
        }
    }
    if (threadIdx.x == 0) out[blockIdx.x] = (unsigned)(tok < 0 ? best : tok);
}
