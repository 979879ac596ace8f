// A step's token choice per output row: greedy argmax, or a seeded draw under temperature,
// top-k, top-p and min-p (cpu twin: draw.rs `draw_row`, which defines the arithmetic; compiled
// with --fmad=false). Weights are integers (units of 2^-46 of the best token's), so every sum
// below is exact in any order: the block's reduction order never changes a token.
//
// draws: DRAW_WORDS u32 a row (temperature, top_k, top_p, min_p as f32 bits, then u's f64 bits,
// low word first), or null: every row greedy. One block of DRAW_THREADS per row. A select finds
// the token at a given position of the best-first order (value, then lowest id), counting
// tokens (top-k) or summing weights (top-p, the draw): a histogram over value bins (x = (v - max)
// / T in [-33, 0] cut in DRAW_VBINS; below -33 a weight is 0), the bin holding the position, its
// tokens gathered into shared memory and ranked there. A bin of more than DRAW_CAP tokens (a
// nearly flat row) is cut again into sub-bins, and one of near-ties takes radix passes over
// the order key.

#define DRAW_THREADS 1024
#define DRAW_WORDS 6
#define DRAW_ONE 70368744177664.0 // 2^46
// A weight's 12-bit limbs (48 bits hold 2^46): each limb of a bin sums in a u32 below 2^32 for up
// to 2^20 tokens (the host checks the width), so the histograms use the native 32-bit shared
// atomics, not a 64-bit compare-and-swap loop (1.8x slower a top-p draw on the H100).
#define DRAW_LIMBS 4
#define DRAW_VBINS 1024
#define DRAW_CATCH DRAW_VBINS // the value bin below -33
#define DRAW_CAP 1024
typedef unsigned long long u64;

__device__ __forceinline__ unsigned draw_key(float v) {
    unsigned b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// x = (v - m) / t as the f32 product with inv_t = 1 / t (draw.rs log_weight: 0 for the best
// token even where inv_t is infinite).
__device__ __forceinline__ float draw_x(float v, float m, float inv_t) {
    float d = __fsub_rn(v, m);
    return d == 0.0f ? 0.0f : __fmul_rn(d, inv_t);
}

// exp(x) in units of 2^-46 (draw.rs weight_of, bit for bit): t = x log2(e), 2^(t - rint(t)) by
// the degree-6 polynomial, its significand shifted into place, rounded half up; 0 below -33
// and for NaN.
__device__ __forceinline__ u64 draw_weight_x(float x) {
    if (!(x >= -33.0f)) return 0;
    float t = __fmul_rn(x, 1.44269502f);
    float n = rintf(t);
    float f = __fsub_rn(t, n);
    float p = 1.540353e-4f;
    p = __fadd_rn(__fmul_rn(p, f), 1.3333558e-3f);
    p = __fadd_rn(__fmul_rn(p, f), 9.618129e-3f);
    p = __fadd_rn(__fmul_rn(p, f), 5.550411e-2f);
    p = __fadd_rn(__fmul_rn(p, f), 2.402265e-1f);
    p = __fadd_rn(__fmul_rn(p, f), 6.931472e-1f);
    p = __fadd_rn(__fmul_rn(p, f), 1.0f);
    unsigned b = __float_as_uint(p);
    u64 m24 = (u64)((b & 0x7fffffu) | 0x800000u);
    int shift = (int)((b >> 23) & 0xffu) - 127 - 23 + (int)n + 46;
    if (shift >= 0) return m24 << shift;
    if (shift > -40) return (m24 + (1ull << (-shift - 1))) >> (-shift);
    return 0;
}

__device__ __forceinline__ u64 draw_weight(float v, float m, float inv_t) { return draw_weight_x(draw_x(v, m, inv_t)); }

// A token's value bin, best first (any function of x that never increases with it would do:
// only a bin's members are ranked by value).
__device__ __forceinline__ int draw_vbin(float x) {
    if (!(x >= -33.0f)) return DRAW_CATCH;
    int b = (int)__fmul_rn(-x, DRAW_VBINS / 33.0f);
    return b < DRAW_VBINS - 1 ? b : DRAW_VBINS - 1;
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
                                            float inv_t) {
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
// measure reaches the target (resolved on the set's total); -1 if none does. Each warp takes a
// contiguous segment of ids: its lanes sum it with coalesced loads, 8 in flight a lane; the block
// scans the warps' sums in order; the warp whose segment holds the target walks it 32 ids at a
// time (a warp scan a step), so no thread walks a run alone.
__device__ int draw_find_in_order(const float* __restrict__ row, int cols, const DrawSet& s, bool mass, float m,
                                  float inv_t, bool use_key, unsigned key_eq, DrawTarget tg, u64* sh, int* found) {
    int nw = blockDim.x >> 5, w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int seg = (cols + nw - 1) / nw;
    int s0 = min(cols, w * seg), s1 = min(cols, s0 + seg);
    auto measure = [&](int i) -> u64 {
        float v = __ldg(row + i);
        unsigned k = draw_key(v);
        return use_key && k != key_eq ? 0 : draw_measure(v, k, i, s, mass, m, inv_t);
    };
    u64 sum = 0;
    for (int c0 = s0; c0 < s1; c0 += 256) {
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int i = c0 + 32 * j + lane;
            v[j] = i < s1 ? __ldg(row + i) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int i = c0 + 32 * j + lane;
            if (i >= s1) continue;
            unsigned k = draw_key(v[j]);
            if (!use_key || k == key_eq) sum += draw_measure(v[j], k, i, s, mass, m, inv_t);
        }
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (threadIdx.x == 0) *found = -1;
    u64 incl = draw_scan(lane == 0 ? sum : 0, sh);  // lane 0: the warps' sums up to its own
    u64 target = draw_resolve(tg, sh[32]);
    incl = __shfl_sync(0xffffffffu, incl, 0);
    if (sum > 0 && incl >= target && incl - sum < target) {  // warp-uniform
        u64 acc = incl - sum;
        for (int c0 = s0; c0 < s1; c0 += 32) {
            int i = c0 + lane;
            u64 x = i < s1 ? measure(i) : 0, inc = x;
            for (int o = 1; o < 32; o <<= 1) {
                u64 n = __shfl_up_sync(0xffffffffu, inc, o);
                if (lane >= o) inc += n;
            }
            u64 tot = __shfl_sync(0xffffffffu, inc, 31);
            if (acc + tot >= target) {
                if (x > 0 && acc + inc >= target && acc + inc - x < target) *found = i;
                break;
            }
            acc += tot;
        }
    }
    __syncthreads();
    int r = *found;
    __syncthreads();
    return r;
}

// f(i, v) for every token i of the row (value v), the block's threads striding over it: each
// thread loads 8 of its tokens before handling any, so one load latency serves 8 (a loop of
// one load a token, each behind the last one's shared atomics, waited ~0.5 us a token on one SM).
template <typename F>
__device__ __forceinline__ void draw_each(const float* __restrict__ row, int cols, F f) {
    const int nb = blockDim.x;
    for (int i0 = threadIdx.x; i0 < cols; i0 += 8 * nb) {
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = i0 + j * nb < cols ? __ldg(row + i0 + j * nb) : 0.0f;
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (i0 + j * nb < cols) f(i0 + j * nb, v[j]);
    }
}

// A block's shared memory for the selects.
struct DrawShared {
    unsigned hist[DRAW_LIMBS][DRAW_VBINS];
    int cand[DRAW_CAP];
    unsigned ckey[DRAW_CAP];
    u64 cmeas[DRAW_CAP];
    u64 sh[33];
    u64 above;
    int found, n;
    unsigned key;
};

__device__ __forceinline__ void draw_hist_add(DrawShared& S, int b, u64 x) {
    for (int j = 0; j < DRAW_LIMBS && x; j++, x >>= 12)
        if (x & 0xfff) atomicAdd(&S.hist[j][b], (unsigned)(x & 0xfff));
}

__device__ __forceinline__ u64 draw_hist_get(const DrawShared& S, int b) {
    u64 h = 0;
    for (int j = 0; j < DRAW_LIMBS; j++) h += (u64)S.hist[j][b] << (12 * j);
    return h;
}

__device__ void draw_hist_clear(DrawShared& S, int nb) {
    for (int b = threadIdx.x; b < nb; b += blockDim.x)
        for (int j = 0; j < DRAW_LIMBS; j++) S.hist[j][b] = 0;
}

// Over the histogram's nb bins in best-first order (bin 0 first when `ascending`, else the last),
// the bin where the running sum reaches the target (resolved on the bins' total when `tg` is
// given, else *target); *target then holds what is left of it inside that bin. -1: the bins
// hold less than the target.
__device__ int draw_pick_bin(DrawShared& S, int nb, bool ascending, const DrawTarget* tg, u64* target) {
    int c = max(1, nb / (int)blockDim.x);
    int p0 = threadIdx.x * c;
    u64 sum = 0;
    for (int q = 0; q < c && p0 + q < nb; q++) sum += draw_hist_get(S, ascending ? p0 + q : nb - 1 - p0 - q);
    if (threadIdx.x == 0) S.found = -1;
    u64 incl = draw_scan(sum, S.sh);
    u64 t = tg ? draw_resolve(*tg, S.sh[32]) : *target;
    if (p0 < nb && sum > 0 && incl >= t && incl - sum < t) {
        u64 acc = incl - sum;
        for (int q = 0; q < c; q++) {
            int b = ascending ? p0 + q : nb - 1 - p0 - q;
            u64 h = draw_hist_get(S, b);
            if (acc + h >= t) {
                S.found = b;
                S.above = acc;
                break;
            }
            acc += h;
        }
    }
    __syncthreads();
    int b = S.found;
    *target = t - (b >= 0 ? S.above : 0);
    __syncthreads();
    return b;
}

// A token's measure in `s` with its value bin (DRAW_CATCH: none to count).
__device__ __forceinline__ u64 draw_measure_bin(float v, unsigned k, int i, const DrawSet& s, bool mass, float m,
                                                float inv_t, int* vb) {
    *vb = DRAW_CATCH;
    if (!draw_in_prefix(k, i, s.kc, s.ic) || !draw_in_prefix(k, i, s.pc, s.pi)) return 0;
    float x = draw_x(v, m, inv_t);
    *vb = draw_vbin(x);
    if (!mass && s.floor == 0) return 1;
    u64 w = draw_weight_x(x);
    if (w < s.floor) return 0;
    return mass ? w : 1;
}

// A token's sub-bin inside value bin b (1024 of them, best first), for a crowded bin.
__device__ __forceinline__ int draw_sbin(float x, int b) {
    int sb = (int)__fmul_rn(__fsub_rn(__fmul_rn(-x, DRAW_VBINS / 33.0f), (float)b), (float)DRAW_VBINS);
    return sb < 0 ? 0 : (sb < DRAW_VBINS - 1 ? sb : DRAW_VBINS - 1);
}

// Whether a token of value x is in bin b and, where sb >= 0, in its sub-bin sb.
__device__ __forceinline__ bool draw_in_bin(float x, int b, int sb) {
    return draw_vbin(x) == b && (sb < 0 || draw_sbin(x, b) == sb);
}

// The tokens of `s` in bin (b, sb), gathered into S.cand / S.ckey by their value alone (no exp:
// a token of measure 0 never holds a position), then measured into S.cmeas; their count (past
// DRAW_CAP: the bin is crowded, only the first DRAW_CAP are kept and the count is a bound).
__device__ int draw_gather(const float* row, int cols, const DrawSet& s, bool mass, float m, float inv_t, int b,
                           int sb, DrawShared& S) {
    if (threadIdx.x == 0) S.n = 0;
    __syncthreads();
    draw_each(row, cols, [&](int i, float v) {
        unsigned k = draw_key(v);
        if (!draw_in_prefix(k, i, s.kc, s.ic) || !draw_in_prefix(k, i, s.pc, s.pi)) return;
        if (!draw_in_bin(draw_x(v, m, inv_t), b, sb)) return;
        // Past DRAW_CAP the count only has to stay past it: no more adds on the one counter (a
        // flat row's bin would take ~V of them).
        if (*(volatile int*)&S.n > DRAW_CAP) return;
        int slot = atomicAdd(&S.n, 1);
        if (slot < DRAW_CAP) {
            S.cand[slot] = i;
            S.ckey[slot] = k;
        }
    });
    __syncthreads();
    int n = S.n;
    for (int t = threadIdx.x; t < min(n, DRAW_CAP); t += blockDim.x) {
        int i = S.cand[t], vb;
        S.cmeas[t] = draw_measure_bin(row[i], S.ckey[t], i, s, mass, m, inv_t, &vb);
    }
    __syncthreads();
    return n;
}

// Among the n <= DRAW_CAP gathered tokens, the one whose running measure in best-first order
// (the candidates before it: a larger key, or the same key and a lower id; then its own)
// reaches the target: its key in S.key, its id returned.
__device__ int draw_rank(DrawShared& S, int n, u64 target) {
    if (threadIdx.x == 0) S.found = -1;
    __syncthreads();
    for (int t = threadIdx.x; t < n; t += blockDim.x) {
        unsigned kt = S.ckey[t];
        int it = S.cand[t];
        u64 before = 0;
        for (int j = 0; j < n; j++) {
            unsigned kj = S.ckey[j];
            if (kj > kt || (kj == kt && S.cand[j] < it)) before += S.cmeas[j];
        }
        if (before < target && before + S.cmeas[t] >= target) {
            S.found = it;
            S.key = kt;
        }
    }
    __syncthreads();
    int r = S.found;
    __syncthreads();
    return r;
}

// The token at the best-first position of `s` where the running measure reaches the target
// (resolved on the set's total): its key in S.key, its id returned. -2: a count past every
// token within 33 T of the best (top-k then keeps every token of nonzero weight: the whole row
// does the same), -1: none (a bug). A value bin of more than DRAW_CAP tokens is cut into
// sub-bins; a sub-bin still that crowded (near-ties) takes radix passes over the order key.
__device__ int draw_select(const float* row, int cols, const DrawSet& s, bool mass, float m, float inv_t,
                           DrawTarget tg, DrawShared& S) {
    draw_hist_clear(S, DRAW_VBINS);
    __syncthreads();
    draw_each(row, cols, [&](int i, float v) {
        int vb;
        u64 x = draw_measure_bin(v, draw_key(v), i, s, mass, m, inv_t, &vb);
        if (x && vb != DRAW_CATCH) draw_hist_add(S, vb, x);
    });
    __syncthreads();
    u64 target = 0;
    int b = draw_pick_bin(S, DRAW_VBINS, true, &tg, &target);
    if (b < 0) return mass ? -1 : -2;
    int n = draw_gather(row, cols, s, mass, m, inv_t, b, -1, S);
    if (n <= DRAW_CAP) return draw_rank(S, n, target);
    // A crowded bin: its sub-bins.
    draw_hist_clear(S, DRAW_VBINS);
    __syncthreads();
    draw_each(row, cols, [&](int i, float v) {
        unsigned k = draw_key(v);
        int vb;
        float xv = draw_x(v, m, inv_t);
        if (draw_vbin(xv) != b) return;
        u64 x = draw_measure_bin(v, k, i, s, mass, m, inv_t, &vb);
        if (x) draw_hist_add(S, draw_sbin(xv, b), x);
    });
    __syncthreads();
    int sb = draw_pick_bin(S, DRAW_VBINS, true, 0, &target);
    if (sb < 0) return -1;
    n = draw_gather(row, cols, s, mass, m, inv_t, b, sb, S);
    if (n <= DRAW_CAP) return draw_rank(S, n, target);
    // Near-ties: radix passes over the sub-bin's order keys (8 bits a pass), then the tied
    // tokens in id order.
    unsigned prefix = 0, pmask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        draw_hist_clear(S, 256);
        __syncthreads();
        draw_each(row, cols, [&](int i, float v) {
            unsigned k = draw_key(v);
            if ((k & pmask) != prefix || !draw_in_bin(draw_x(v, m, inv_t), b, sb)) return;
            int vb;
            u64 x = draw_measure_bin(v, k, i, s, mass, m, inv_t, &vb);
            if (x) draw_hist_add(S, (k >> shift) & 255, x);
        });
        __syncthreads();
        int d = draw_pick_bin(S, 256, false, 0, &target);
        if (d < 0) return -1;
        prefix |= (unsigned)d << shift;
        pmask |= 255u << shift;
    }
    S.key = prefix;
    DrawTarget rest = {0, target, 0.0};
    return draw_find_in_order(row, cols, s, mass, m, inv_t, true, prefix, rest, S.sh, &S.found);
}

// out[r] = row r's token (draw.rs draw_row): the first index of the maximum when greedy (NaN
// never wins; a row of NaN gives 0), else the seeded draw.
extern "C" __global__ void __launch_bounds__(DRAW_THREADS) draw_rows(unsigned* out, const float* x,
                                                                   const unsigned* draws, int cols) {
    pdl_enter();
    __shared__ DrawShared S;
    __shared__ float sv[32];
    __shared__ int si[32];
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
    float inv_t = __fdiv_rn(1.0f, temp);
    DrawSet s = {0u, 0u, 0x7fffffff, 0x7fffffff, 0ull};
    DrawTarget draw = {2, 0, u};
    int tok;
    if (top_k == 0 && !(top_p < 1.0f) && !(min_p > 0.0f)) {
        // No filter: the draw walks the whole row in id order.
        tok = draw_find_in_order(row, cols, s, true, bv, inv_t, false, 0, draw, S.sh, &S.found);
    } else {
        tok = 0;
        if (top_k > 0 && top_k < (unsigned)cols) {
            DrawTarget k = {0, top_k, 0.0};
            int id = draw_select(row, cols, s, false, bv, inv_t, k, S);
            if (id >= 0) {
                s.kc = S.key;
                s.ic = id;
            }
            tok = id == -1 ? -1 : 0;
        }
        if (tok >= 0 && top_p < 1.0f) {
            DrawTarget cut = {1, 0, (double)top_p};
            int id = draw_select(row, cols, s, true, bv, inv_t, cut, S);
            s.pc = S.key;
            s.pi = id;
            tok = id < 0 ? -1 : 0;
        }
        if (tok >= 0) {
            s.floor = min_p > 0.0f ? (u64)ceil((double)min_p * DRAW_ONE) : 0ull;
            tok = draw_select(row, cols, s, true, bv, inv_t, draw, S);
        }
    }
    if (threadIdx.x == 0) out[blockIdx.x] = (unsigned)(tok < 0 ? best : tok);
}
