// Compressor (spec §9.2), lightning indexer (§5.5) and sink-softmax attention (§5.6).
// Launchers: cuda/attention.rs. Device state per layer (cuda/state.rs), for S sequence slots:
//   raw_u/raw_z [S, K, w]      raw compressor rows (u, and z + ape) of position p at slot p mod K,
//                              K = (overlap ? 2 : 1)·m + MAX_ROLLBACK: the open window, the last
//                              closed one (its A-halves, CSA) and the rows a rollback needs
//   entries     [S, cap, hd]   entry i pooled from window i; the first len / m are live
//   ring        [S, rcap, d]   KV rows at slot pos mod rcap, rcap = window + MAX_ROLLBACK
// Nothing is ever cleared: a sequence of length len reads only rows of positions < len, and a
// rollback (cuda/state.rs) only lowers len.

// The (u, z) row of position q of row t's sequence while a chunk is fed: rows at or after the
// segment's first position come from this batch (z + ape), earlier ones from the raw ring.
struct CompSrc {
    const float *u, *z, *raw_u, *raw_z, *ape;
    int m, w, k;
};

__device__ __forceinline__ void comp_row(const CompSrc& s, const unsigned* rows, int n, int t, long long q,
                                         const float** ur, const float** zr, const float** ar) {
    long long pos0 = ROW_POS0(t);
    if (q >= pos0) {
        long long r = ROW_START(t) + (q - pos0);
        *ur = s.u + r * s.w;
        *zr = s.z + r * s.w;
        *ar = s.ape + (q % s.m) * s.w;
    } else {
        long long o = ((long long)ROW_SEQ(t) * s.k + q % s.k) * s.w;
        *ur = s.raw_u + o;
        *zr = s.raw_z + o;
        *ar = 0;
    }
}

// One block per batch row; rows that close a window pool it (per-channel softmax over the gate),
// RMSNorm it, rotate it at position win·m and store entry `win`. With overlap (CSA) the previous
// window's A-halves join the softmax; window 0 has none (u = 0, z = −∞: they add exactly
// nothing). Dynamic shared memory: hd floats.
extern "C" __global__ void comp_pool(float* entries, int cap, const float* u, const float* z, const float* raw_u,
                                     const float* raw_z, int k, const float* ape, const float* norm,
                                     const double* freqs, int npairs, const unsigned* rows, int n, int m, int hd,
                                     int overlap, float eps) {
    extern __shared__ float buf[];
    __shared__ float sh[32];
    int t = blockIdx.x;
    long long p = ROW_POS(t);
    if ((p + 1) % m != 0) return;
    long long win = (p + 1) / m - 1, seq = ROW_SEQ(t);
    CompSrc s = {u, z, raw_u, raw_z, ape, m, overlap ? 2 * hd : hd, k};
    for (int c = threadIdx.x; c < hd; c += blockDim.x) {
        float mx = -INFINITY;
        for (int pass = 0; pass < 2; pass++) {
            float den = 0.f, num = 0.f;
            if (overlap && win > 0) {
                for (int r = 0; r < m; r++) {
                    const float *ur, *zr, *ar;
                    comp_row(s, rows, n, t, (win - 1) * m + r, &ur, &zr, &ar);
                    float zv = ar ? zr[c] + ar[c] : zr[c];
                    float uv = ur[c];
                    if (pass == 0) mx = fmaxf(mx, zv);
                    else { float e = expf(zv - mx); den += e; num += e * uv; }
                }
            }
            int off = overlap ? hd : 0;
            for (int r = 0; r < m; r++) {
                const float *ur, *zr, *ar;
                comp_row(s, rows, n, t, win * m + r, &ur, &zr, &ar);
                float zv = ar ? zr[off + c] + ar[off + c] : zr[off + c];
                if (pass == 0) mx = fmaxf(mx, zv);
                else { float e = expf(zv - mx); den += e; num += e * ur[off + c]; }
            }
            if (pass == 1) buf[c] = num / den;
        }
    }
    __syncthreads();
    float ss = 0.f;
    for (int c = threadIdx.x; c < hd; c += blockDim.x) ss += buf[c] * buf[c];
    ss = block_sum(ss, sh);
    float r = 1.0f / sqrtf(ss / (float)hd + eps);
    for (int c = threadIdx.x; c < hd; c += blockDim.x) buf[c] = buf[c] * r * norm[c];
    __syncthreads();
    float* out = entries + (seq * cap + win) * hd;
    int rb = hd - 2 * npairs;
    for (int c = threadIdx.x; c < hd; c += blockDim.x) {
        if (c < rb) { out[c] = buf[c]; continue; }
        int j = (c - rb) / 2;
        double th = (double)(win * m) * freqs[j];
        float sn = (float)sin(th), cs = (float)cos(th);
        float a = buf[rb + 2 * j], b = buf[rb + 2 * j + 1];
        out[c] = ((c - rb) & 1) ? a * sn + b * cs : a * cs - b * sn;
    }
}

// After comp_pool: the last min(len, K) rows of each segment enter the raw ring (z + ape).
extern "C" __global__ void comp_store(float* raw_u, float* raw_z, int k, const float* u, const float* z,
                                      const float* ape, const unsigned* rows, int n, int m, int w) {
    GRID_STRIDE(e, (long long)n * w) {
        int t = (int)(e / w), c = (int)(e % w);
        long long p = ROW_POS(t), end = (long long)ROW_POS0(t) + ROW_LEN(t);
        if (p + k < end) continue;
        long long o = ((long long)ROW_SEQ(t) * k + p % k) * w + c;
        raw_u[o] = u[(long long)t * w + c];
        raw_z[o] = z[(long long)t * w + c] + ape[(p % m) * w + c];
    }
}

// Indexer scores: one warp per (row, entry), striding over the row's entries; score = Σ_h w_h·ws·max(q_h·k, 0)·qs.
extern "C" __global__ void index_score(float* scores, int maxvis, const float* q, const float* wts,
                                       const float* entries, int cap, const unsigned* rows, int n, int m, int nh,
                                       int hd, float qs, float ws) {
    int t = blockIdx.x, lane = threadIdx.x & 31;
    long long vis = ((long long)ROW_POS(t) + 1) / m;
    const float* qr = q + (long long)t * nh * hd;
    int warps = blockDim.x >> 5;
    for (long long s = blockIdx.y * warps + (threadIdx.x >> 5); s < vis; s += (long long)gridDim.y * warps) {
        const float* k = entries + ((long long)ROW_SEQ(t) * cap + s) * hd;
        float acc = 0.f;
        // 8 heads' dot products at a time: their butterflies are independent and overlap
        // (one head after another waited on every shuffle). Each head's sum and the sum over
        // heads keep their order, so the scores are bitwise the one-head-at-a-time ones.
        for (int h0 = 0; h0 < nh; h0 += 8) {
            float d[8];
#pragma unroll
            for (int u = 0; u < 8; u++) {
                d[u] = 0.f;
                if (h0 + u < nh)
                    for (int c = lane; c < hd; c += 32) d[u] += qr[(h0 + u) * hd + c] * k[c];
            }
#pragma unroll
            for (int u = 0; u < 8; u++) d[u] = warp_sum(d[u]);
#pragma unroll
            for (int u = 0; u < 8; u++)
                if (h0 + u < nh) acc += wts[(long long)t * nh + h0 + u] * ws * (fmaxf(d[u], 0.f) * qs);
        }
        if (lane == 0) scores[(long long)t * maxvis + s] = acc;
    }
}

// Order-preserving map of a float to an unsigned key (larger float, larger key).
__device__ __forceinline__ unsigned fkey(float x) {
    unsigned b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

#define TOPK_MAX 2048

// Top-k per row: sel[t, j] for j < min(topk, vis), score descending, ties to the lower entry
// index (the CPU's order). O(vis) per row: (1) the k-th largest key T, bit by bit from the top
// (32 block-wide counts); (2) every key > T, then keys == T in index order until k; (3) a
// bitonic sort of those k in shared memory. `topk` <= TOPK_MAX (checked by the launcher).
extern "C" __global__ void index_topk(unsigned* sel, int topk, const float* scores, int maxvis, const unsigned* rows,
                                      int n, int m) {
    __shared__ unsigned skey[TOPK_MAX];
    __shared__ unsigned sidx[TOPK_MAX];
    __shared__ unsigned cnt;
    __shared__ float red[32];
    __shared__ unsigned wsum[32];
    int t = blockIdx.x;
    int vis = (int)(((long long)ROW_POS(t) + 1) / m);
    int k = min(topk, vis);
    if (k <= 0) return;
    const float* sc = scores + (long long)t * maxvis;
    unsigned thr = 0;
    for (int bit = 31; bit >= 0; bit--) {
        unsigned cand = thr | (1u << bit);
        int c = 0;
        for (int s = threadIdx.x; s < vis; s += blockDim.x) c += fkey(sc[s]) >= cand;
        if (block_sum((float)c, red) >= (float)k) thr = cand;  // counts < 2^24: exact in f32
    }
    if (threadIdx.x == 0) cnt = 0;
    __syncthreads();
    for (int s = threadIdx.x; s < vis; s += blockDim.x) {
        unsigned key = fkey(sc[s]);
        if (key > thr) {
            unsigned p = atomicAdd(&cnt, 1u);
            skey[p] = key;
            sidx[p] = (unsigned)s;
        }
    }
    __syncthreads();
    unsigned g = cnt;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int base = 0; base < vis && g < (unsigned)k; base += blockDim.x) {
        int s = base + threadIdx.x;
        bool tie = s < vis && fkey(sc[s]) == thr;
        unsigned ball = __ballot_sync(0xffffffffu, tie);
        if (lane == 0) wsum[w] = __popc(ball);
        __syncthreads();
        unsigned before = __popc(ball & ((1u << lane) - 1)), total = 0;
        for (int i = 0; i < nw; i++) {
            if (i < w) before += wsum[i];
            total += wsum[i];
        }
        if (tie && g + before < (unsigned)k) {
            skey[g + before] = thr;
            sidx[g + before] = (unsigned)s;
        }
        __syncthreads();
        g = min((unsigned)k, g + total);
    }
    int np = 1;
    while (np < k) np <<= 1;
    for (int i = k + threadIdx.x; i < np; i += blockDim.x) {
        skey[i] = 0;
        sidx[i] = 0xffffffffu;
    }
    __syncthreads();
    for (int size = 2; size <= np; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < np; i += blockDim.x) {
                int j = i ^ stride;
                if (j > i) {
                    unsigned ka = skey[i], kb = skey[j], ia = sidx[i], ib = sidx[j];
                    bool a_first = ka > kb || (ka == kb && ia < ib);
                    if (a_first != ((i & size) == 0)) {
                        skey[i] = kb; skey[j] = ka;
                        sidx[i] = ib; sidx[j] = ia;
                    }
                }
            }
            __syncthreads();
        }
    }
    for (int j = threadIdx.x; j < k; j += blockDim.x) sel[(long long)t * topk + j] = sidx[j];
}

#define ATT_WARPS 16  // keys split over 16 warps: a decode row still fills a block per head
#define ATT_KB 4      // keys a warp takes at a time
#define MAX_D 512

// Sink-softmax attention of one (row, head) per block over the row's window rows (ring before the
// chunk, this batch's kv from the chunk on) and its compressed entries (selected, or all visible).
// Each warp runs an online softmax over every ATT_WARPS-th key; the warps are merged at the end.
extern "C" __global__ void attention(float* out, const float* q, const float* kv, const float* ring, int win,
                                     int rcap, const float* entries, int cap, int m, const unsigned* sel,
                                     int has_sel, int topk, const float* sinks, const unsigned* rows, int n,
                                     int heads, int d, float scale) {
    __shared__ float wm[ATT_WARPS], wl[ATT_WARPS];
    __shared__ float wo[ATT_WARPS][MAX_D];
    int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x & 31, wp = threadIdx.x >> 5;
    long long p = ROW_POS(t), pos0 = ROW_POS0(t), seq = ROW_SEQ(t);
    long long lo = p + 1 > win ? p + 1 - win : 0;
    int nwin = (int)(p - lo + 1);
    int ncomp = 0;
    if (m > 0) {
        int vis = (int)((p + 1) / m);
        ncomp = has_sel ? min(topk, vis) : vis;
    }
    const float* qr = q + ((long long)t * heads + h) * d;
    float qv[MAX_D / 32], o[MAX_D / 32];
#pragma unroll
    for (int i = 0; i < MAX_D / 32; i++) {
        int c = lane + 32 * i;
        qv[i] = c < d ? qr[c] : 0.f;
        o[i] = 0.f;
    }
    float mx = -INFINITY, l = 0.f;
    // ATT_KB keys a warp at a time (keys j, j + ATT_WARPS, ...): their loads and butterflies
    // overlap, where one key at a time waited on each (a decode row's ~40 keys a warp were ~40
    // dependent round trips). The online softmax takes the group's maximum first.
    int nk = nwin + ncomp;
    for (int j0 = wp; j0 < nk; j0 += ATT_WARPS * ATT_KB) {
        const float* kp[ATT_KB];
        float sc[ATT_KB];
#pragma unroll
        for (int u = 0; u < ATT_KB; u++) {
            int j = j0 + u * ATT_WARPS;
            const float* k = nullptr;
            if (j < nwin) {
                long long pp = lo + j;
                k = pp < pos0 ? ring + (seq * rcap + pp % rcap) * d : kv + (ROW_START(t) + (pp - pos0)) * d;
            } else if (j < nk) {
                long long e = has_sel ? sel[(long long)t * topk + (j - nwin)] : (j - nwin);
                k = entries + (seq * cap + e) * d;
            }
            kp[u] = k;
            float dot = 0.f;
            if (k) {
#pragma unroll
                for (int i = 0; i < MAX_D / 32; i++) {
                    int c = lane + 32 * i;
                    if (c < d) dot += qv[i] * k[c];
                }
            }
            sc[u] = dot;
        }
#pragma unroll
        for (int u = 0; u < ATT_KB; u++) sc[u] = kp[u] ? warp_sum(sc[u]) * scale : -INFINITY;
        float nm = mx;
#pragma unroll
        for (int u = 0; u < ATT_KB; u++) nm = fmaxf(nm, sc[u]);
        // The group's first key is always a key, so nm is finite where the scores are.
        float corr = expf(mx - nm);
        l = l * corr;
#pragma unroll
        for (int i = 0; i < MAX_D / 32; i++) o[i] = o[i] * corr;
#pragma unroll
        for (int u = 0; u < ATT_KB; u++) {
            if (!kp[u]) continue;
            float pw = expf(sc[u] - nm);
            l = l + pw;
#pragma unroll
            for (int i = 0; i < MAX_D / 32; i++) {
                int c = lane + 32 * i;
                if (c < d) o[i] = o[i] + pw * kp[u][c];
            }
        }
        mx = nm;
    }
    if (lane == 0) { wm[wp] = mx; wl[wp] = l; }
#pragma unroll
    for (int i = 0; i < MAX_D / 32; i++) {
        int c = lane + 32 * i;
        if (c < d) wo[wp][c] = o[i];
    }
    __syncthreads();
    float M = sinks[h];
    for (int w = 0; w < ATT_WARPS; w++) M = fmaxf(M, wm[w]);
    float den = expf(sinks[h] - M);
    for (int w = 0; w < ATT_WARPS; w++) den += wl[w] * expf(wm[w] - M);
    float* orow = out + ((long long)t * heads + h) * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = 0.f;
        for (int w = 0; w < ATT_WARPS; w++) acc += wo[w][c] * expf(wm[w] - M);
        orow[c] = acc / den;
    }
}

// After attention: the last min(len, rcap) rows of each segment enter the window ring.
extern "C" __global__ void ring_write(float* ring, int rcap, const float* kv, const unsigned* rows, int n, int d) {
    GRID_STRIDE(e, (long long)n * d) {
        int t = (int)(e / d), c = (int)(e % d);
        long long i = t - (long long)ROW_START(t), len = ROW_LEN(t);
        if (i < len - min(len, (long long)rcap)) continue;
        long long p = ROW_POS(t);
        ring[((long long)ROW_SEQ(t) * rcap + p % rcap) * d + c] = kv[(long long)t * d + c];
    }
}
