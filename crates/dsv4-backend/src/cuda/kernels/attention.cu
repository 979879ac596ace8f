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
    pdl_enter();
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
    pdl_enter();
    GRID_STRIDE(e, (long long)n * w) {
        int t = (int)(e / w), c = (int)(e % w);
        long long p = ROW_POS(t), end = (long long)ROW_POS0(t) + ROW_LEN(t);
        if (p + k < end) continue;
        long long o = ((long long)ROW_SEQ(t) * k + p % k) * w + c;
        raw_u[o] = u[(long long)t * w + c];
        raw_z[o] = z[(long long)t * w + c] + ape[(p % m) * w + c];
    }
}

// Indexer scores: score = Σ_h w_h·ws·max(q_h·k, 0)·qs. Block (row, y): the row's queries are
// staged transposed (qT[c][h], rows padded to nh + 1: conflict-free both ways) with their
// weights; each warp takes IDX_EW entries at a time (entries y·8·IDX_EW + w·IDX_EW + ...,
// stepping by the grid), stages their keys, and lane j owns heads j, j + 32, ...: each qT read
// serves IDX_EW entries and each key read (a broadcast) IDX_HPL heads. One butterfly sums the
// heads. Dynamic shared memory: (hd·(nh + 1) + 8·IDX_EW·hd + nh) floats.
#define IDX_HPL 4  // heads a lane owns at most (nh <= 128)
#define IDX_EW 4   // entries a warp scores at a time
extern "C" __global__ void index_score(float* scores, int maxvis, const float* q, const float* wts,
                                       const float* entries, int cap, const unsigned* rows, int n, int m, int nh,
                                       int hd, float qs, float ws) {
    pdl_enter();
    extern __shared__ float sm[];
    int qst = nh + 1;
    float* qT = sm;                       // [hd][nh + 1]
    float* kb = sm + hd * qst;            // [8][IDX_EW][hd]
    float* wv = kb + 8 * IDX_EW * hd;     // [nh]
    int t = blockIdx.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    long long vis = ((long long)ROW_POS(t) + 1) / m;
    long long step = (long long)gridDim.y * 8 * IDX_EW;
    if ((long long)blockIdx.y * 8 * IDX_EW >= vis) return;
    const float* qr = q + (long long)t * nh * hd;
    for (int i = threadIdx.x; i < nh * hd; i += blockDim.x) qT[(i % hd) * qst + i / hd] = qr[i];
    for (int h = threadIdx.x; h < nh; h += blockDim.x) wv[h] = wts[(long long)t * nh + h] * ws;
    __syncthreads();
    float* kw = kb + w * IDX_EW * hd;
    for (long long s0 = ((long long)blockIdx.y * 8 + w) * IDX_EW; s0 < vis; s0 += step) {
        int ne = (int)min((long long)IDX_EW, vis - s0);
        const float* k = entries + ((long long)ROW_SEQ(t) * cap + s0) * hd;
        __syncwarp();
        for (int c = lane; c < IDX_EW * hd; c += 32) kw[c] = c < ne * hd ? k[c] : 0.f;
        __syncwarp();
        float d[IDX_HPL][IDX_EW];
#pragma unroll
        for (int j = 0; j < IDX_HPL; j++)
#pragma unroll
            for (int e = 0; e < IDX_EW; e++) d[j][e] = 0.f;
#pragma unroll 2
        for (int c = 0; c < hd; c++) {
            float kc[IDX_EW];
#pragma unroll
            for (int e = 0; e < IDX_EW; e++) kc[e] = kw[e * hd + c];
#pragma unroll
            for (int j = 0; j < IDX_HPL; j++) {
                if (32 * j >= nh) break;
                float qv = lane + 32 * j < nh ? qT[c * qst + lane + 32 * j] : 0.f;
#pragma unroll
                for (int e = 0; e < IDX_EW; e++) d[j][e] += qv * kc[e];
            }
        }
#pragma unroll
        for (int e = 0; e < IDX_EW; e++) {
            float acc = 0.f;
#pragma unroll
            for (int j = 0; j < IDX_HPL; j++)
                if (lane + 32 * j < nh) acc += wv[lane + 32 * j] * (fmaxf(d[j][e], 0.f) * qs);
            acc = warp_sum(acc);
            if (lane == 0 && e < ne) scores[(long long)t * maxvis + s0 + e] = acc;
        }
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
    pdl_enter();
    __shared__ unsigned skey[TOPK_MAX];
    __shared__ unsigned sidx[TOPK_MAX];
    __shared__ unsigned cnt;
    __shared__ unsigned wsum[32];
    int t = blockIdx.x;
    int vis = (int)(((long long)ROW_POS(t) + 1) / m);
    int k = min(topk, vis);
    if (k <= 0) return;
    const float* sc = scores + (long long)t * maxvis;
    // T, the k-th largest key, one byte at a time from the top: a histogram of the next byte
    // over the keys that share the bytes found so far, and warp 0 finds the byte at which the
    // count from the top reaches the rank still wanted.
    __shared__ unsigned hist[256];
    __shared__ unsigned s_digit, s_above;
    unsigned thr = 0, pmask = 0, want = (unsigned)k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int s = threadIdx.x; s < vis; s += blockDim.x) {
            unsigned key = fkey(sc[s]);
            if ((key & pmask) == thr) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            int lane = threadIdx.x;
            unsigned c[8], tot = 0;  // lane l: bins 255 − 8l down to 248 − 8l
#pragma unroll
            for (int i = 0; i < 8; i++) { c[i] = hist[255 - 8 * lane - i]; tot += c[i]; }
            unsigned inc = tot;
            for (int o = 1; o < 32; o <<= 1) {
                unsigned v = __shfl_up_sync(0xffffffffu, inc, o);
                if (lane >= o) inc += v;
            }
            unsigned exc = inc - tot;
            unsigned ball = __ballot_sync(0xffffffffu, exc < want && inc >= want);
            if (lane == __ffs(ball) - 1) {
                unsigned cum = exc;
                for (int i = 0; i < 8; i++) {
                    if (cum + c[i] >= want) { s_digit = 255u - 8u * lane - i; s_above = cum; break; }
                    cum += c[i];
                }
            }
        }
        __syncthreads();
        want -= s_above;
        thr |= s_digit << shift;
        pmask |= 255u << shift;
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

#define ATT_S 16   // slices a row's keys are split into at most (the grid's z)
// Keys a slice takes at least: a row of nk keys uses S = min(ATT_S, ⌈nk / ATT_MINK⌉) slices, a
// function of the row alone (its position and selection), so its sums never depend on its batch.
// The other blocks of its grid count themselves and return. With 16 slices always, a 128-key
// window gave 8 keys a block, and at batch 16 its 2,048 blocks ran in ~8 waves of a chain of
// loads, a partial write and a 16-way merge (SWA 83 µs at batch 16, PERF.md v16).
#ifndef ATT_MINK
#define ATT_MINK 32
#endif
#define ATT_HG 8   // heads a block takes, one warp each: they share each staged key group
#define ATT_KG 4   // keys a warp takes at a time (a group: one stage of the copy ring)
#ifndef ATT_ST
#define ATT_ST 5   // stages of the copy ring: ATT_ST − 1 groups' loads in flight ahead of the math (≤ 5: 48 KB static)
#endif
#define ATT_KP 128 // key addresses looked up at a time (a multiple of ATT_KG, >= (ATT_ST - 1)·ATT_KG)
#define ATT_CJ 4   // slices the merge loads at a time
#define MAX_D 512
#ifndef ATT_MINB
#define ATT_MINB 2  // blocks an SM (registers ≤ 128): batch decode runs rows × 128 blocks in waves
#endif
#define ATT_CPG (ATT_KG * MAX_D / 4 / (32 * ATT_HG))  // 16-byte copies a thread issues a group (at most)

// Key j of row t: its window rows first (the ring before the chunk, this batch's kv from the
// chunk on), then its compressed entries (selected, or every visible one).
__device__ __forceinline__ const float* att_key(int j, int nwin, long long lo, const float* kv, const float* ring,
                                                int rcap, const float* entries, int cap, const unsigned* sel,
                                                int has_sel, int topk, const unsigned* rows, int n, int t, int d) {
    long long seq = ROW_SEQ(t);
    if (j < nwin) {
        long long pp = lo + j, pos0 = ROW_POS0(t);
        return pp < pos0 ? ring + (seq * rcap + pp % rcap) * d : kv + (ROW_START(t) + (pp - pos0)) * d;
    }
    long long e = has_sel ? sel[(long long)t * topk + (j - nwin)] : (j - nwin);
    return entries + (seq * cap + e) * d;
}

__device__ __forceinline__ void att_cp16(float* dst, const float* src) {
    unsigned sa = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa), "l"(src) : "memory");
}
__device__ __forceinline__ void att_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void att_cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(ATT_ST - 2) : "memory"); }

// Sink-softmax attention (values are the keys), flash-decoding style. Block (row, head group,
// slice): slice s of the row's S (see ATT_MINK) takes its keys [s·nk/S, (s+1)·nk/S) in groups of
// ATT_KG, copied (cp.async) into a ring of ATT_ST shared-memory stages: ATT_ST − 1 groups' loads
// are in flight while a group's math runs, so the slice pays about one memory latency, not one a
// tile. Its ATT_HG heads (one warp each) share each staged group; an online softmax over the
// slice leaves (max, sum, o) in `part`. The group's last slice block to finish merges the S
// partials in slice order with the sink. Rows are t0 + blockIdx.x (the launcher tiles rows so
// that `part` stays small); `done` counts finished slices per (tile row, group) and is left zero.
extern "C" __global__ void __launch_bounds__(32 * ATT_HG, ATT_MINB) attention(float* out, float* part, unsigned* done, const float* q, const float* kv,
                                     const float* ring, int win, int rcap, const float* entries, int cap, int m,
                                     const unsigned* sel, int has_sel, int topk, const float* sinks,
                                     const unsigned* rows, int n, int t0, int heads, int d, float scale) {
    pdl_enter();
    __shared__ __align__(16) float ks[ATT_ST][ATT_KG][MAX_D];
    __shared__ const float* kp[ATT_KP];
    __shared__ unsigned last;
    int tl = blockIdx.x, t = t0 + tl, g = blockIdx.y, s = blockIdx.z;
    int lane = threadIdx.x & 31, wp = threadIdx.x >> 5, h = g * ATT_HG + wp;
    bool live = h < heads;
    float sink = live ? sinks[h] : 0.f;  // only the merging block uses it; its load is off the chain here
    long long p = ROW_POS(t);
    long long lo = p + 1 > win ? p + 1 - win : 0;
    int nwin = (int)(p - lo + 1);
    int ncomp = 0;
    if (m > 0) {
        int vis = (int)((p + 1) / m);
        ncomp = has_sel ? min(topk, vis) : vis;
    }
    int nk = nwin + ncomp;
    const int S = min(ATT_S, max(1, (nk + ATT_MINK - 1) / ATT_MINK));
    int j0 = (int)((long long)nk * s / S), j1 = (int)((long long)nk * (s + 1) / S);
    int G = gridDim.y;
    if (s < S) {  // block-uniform: slices past S hold no keys
        int nks = j1 - j0, ng = (nks + ATT_KG - 1) / ATT_KG;
        // The first ATT_KP keys' addresses in one round trip (a selected entry's index is itself a load).
        if (threadIdx.x < min(ATT_KP, nks))
            kp[threadIdx.x] = att_key(j0 + threadIdx.x, nwin, lo, kv, ring, rcap, entries, cap, sel, has_sel, topk,
                                      rows, n, t, d);
        float qv[MAX_D / 32], o[MAX_D / 32];
        const float* qr = q + ((long long)t * heads + (live ? h : 0)) * d;
#pragma unroll
        for (int i = 0; i < MAX_D / 32; i++) {
            int c = lane + 32 * i;
            qv[i] = c < d ? qr[c] : 0.f;
            o[i] = 0.f;
        }
        // Columns d..MAX_D are never copied: zero (qv is zero there too, so they add exactly zero).
        if (d < MAX_D)
            for (int i = threadIdx.x; i < ATT_ST * ATT_KG * (MAX_D - d); i += blockDim.x) {
                int r = i / (MAX_D - d);
                (&ks[0][0][0])[r * MAX_D + d + (i - r * (MAX_D - d))] = 0.f;
            }
        // This thread's copies of a group (blockDim = 32·ATT_HG covers its ATT_KG·d4 16-byte chunks):
        // chunk i = tid + u·blockDim is key i / d4's float4 i % d4.
        int d4 = d >> 2, ck[ATT_CPG], cc[ATT_CPG];
#pragma unroll
        for (int u = 0; u < ATT_CPG; u++) {
            int i = threadIdx.x + u * blockDim.x;
            ck[u] = i < ATT_KG * d4 ? i / d4 : ATT_KG;
            cc[u] = i - ck[u] * d4;
        }
        // Group gi's copies into stage gi mod ATT_ST (one commit a call, empty past the slice). A
        // short last group's missing rows are zero: finite, so their weight-0 products add exactly 0.
        auto issue = [&](int gi) {
            if (gi < ng) {
                int k = gi * ATT_KG, nt = min(ATT_KG, nks - k), pb = k % ATT_KP;
                float* st = &ks[gi % ATT_ST][0][0];
#pragma unroll
                for (int u = 0; u < ATT_CPG; u++) {
                    if (ck[u] >= ATT_KG) continue;
                    float* dst = st + ck[u] * MAX_D + 4 * cc[u];
                    if (ck[u] < nt) att_cp16(dst, kp[pb + ck[u]] + 4 * cc[u]);
                    else *reinterpret_cast<float4*>(dst) = make_float4(0.f, 0.f, 0.f, 0.f);
                }
            }
            att_cp_commit();
        };
        __syncthreads();  // kp (and the zero columns) written
#pragma unroll
        for (int gi = 0; gi < ATT_ST - 1; gi++) issue(gi);
        float mx = -INFINITY, l = 0.f;
#pragma unroll 1
        for (int gc = 0; gc < ng; gc++) {
            att_cp_wait();    // this thread's copies of group gc have landed
            __syncthreads();  // everyone's have, and every warp is done with group gc − 1's stage
            int gn = gc + ATT_ST - 1;
            if (gn < ng && (gn * ATT_KG) % ATT_KP == 0) {  // the next ATT_KP addresses (no reader is left)
                if (threadIdx.x < min(ATT_KP, nks - gn * ATT_KG))
                    kp[threadIdx.x] = att_key(j0 + gn * ATT_KG + threadIdx.x, nwin, lo, kv, ring, rcap, entries, cap,
                                              sel, has_sel, topk, rows, n, t, d);
                __syncthreads();
            }
            issue(gn);  // into group gc − 1's stage
            if (!live) continue;
            // ATT_KG keys at a time: their dot products' butterflies overlap; each key's values are
            // read from shared memory once, for the dot product and again (from registers) for the
            // weighted sum.
            const float* kb = &ks[gc % ATT_ST][0][0];
            int nt = min(ATT_KG, nks - gc * ATT_KG);
            float kr[ATT_KG][MAX_D / 32], sc[ATT_KG];
#pragma unroll
            for (int u = 0; u < ATT_KG; u++) {
                float dot = 0.f;
#pragma unroll
                for (int i = 0; i < MAX_D / 32; i++) {
                    kr[u][i] = kb[u * MAX_D + lane + 32 * i];
                    dot = fmaf(qv[i], kr[u][i], dot);
                }
                sc[u] = dot;
            }
            // The ATT_KG butterflies level by level (interleaved: one shuffle latency a level, not
            // one a key and level), every lane in the same tree, so every lane gets the same sums.
#pragma unroll
            for (int x = 16; x > 0; x >>= 1)
#pragma unroll
                for (int u = 0; u < ATT_KG; u++) sc[u] += __shfl_xor_sync(0xffffffffu, sc[u], x);
#pragma unroll
            for (int u = 0; u < ATT_KG; u++) sc[u] = u < nt ? sc[u] * scale : -INFINITY;
            float nm = mx;
#pragma unroll
            for (int u = 0; u < ATT_KG; u++) nm = fmaxf(nm, sc[u]);
            // The group's first key is a key, so nm is finite where the scores are.
            float corr = expf(mx - nm);
            l = l * corr;
#pragma unroll
            for (int i = 0; i < MAX_D / 32; i++) o[i] = o[i] * corr;
#pragma unroll
            for (int u = 0; u < ATT_KG; u++) {
                float pw = expf(sc[u] - nm);  // 0 past the slice's end (sc = −∞)
                l = l + pw;
#pragma unroll
                for (int i = 0; i < MAX_D / 32; i++) o[i] = fmaf(pw, kr[u][i], o[i]);
            }
            mx = nm;
        }
        if (live) {
            float* pr = part + (((long long)tl * heads + h) * ATT_S + s) * (d + 2);
#pragma unroll
            for (int i = 0; i < MAX_D / 32; i++) {
                int c = lane + 32 * i;
                if (c < d) pr[c] = o[i];
            }
            if (lane == 0) { pr[d] = mx; pr[d + 1] = l; }
        }
    }  // s < S
    // Publish the partial, then count it; the block that completes the count merges. One thread
    // fences for the block after the barrier (the pattern of cooperative groups' grid sync).
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        unsigned prev = atomicAdd(&done[tl * G + g], 1u);
        last = prev == ATT_S - 1;
        if (last) {
            done[tl * G + g] = 0;  // every other slice has counted: ready for the next launch
            __threadfence();
        }
    }
    __syncthreads();
    if (!last || !live) return;
    const float* ph = part + ((long long)tl * heads + h) * ATT_S * (d + 2);
    // The first ATT_CJ slices' values are loaded with the statistics: one round trip for S <= ATT_CJ.
    float v[ATT_CJ][MAX_D / 32];
#pragma unroll
    for (int u = 0; u < ATT_CJ; u++)
#pragma unroll
        for (int i = 0; i < MAX_D / 32; i++) {
            int c = lane + 32 * i;
            v[u][i] = c < d && u < S ? __ldcg(ph + u * (d + 2) + c) : 0.f;
        }
    // Lane s < S holds slice s's weight exp(m_s − M) / den; M covers the sink too.
    float ms = lane < S ? __ldcg(ph + lane * (d + 2) + d) : -INFINITY;
    float ls = lane < S ? __ldcg(ph + lane * (d + 2) + d + 1) : 0.f;
    float M = sink;
    for (int i = 0; i < S; i++) M = fmaxf(M, __shfl_sync(0xffffffffu, ms, i));
    float den = expf(sink - M);
    for (int i = 0; i < S; i++) den += __shfl_sync(0xffffffffu, ls, i) * expf(__shfl_sync(0xffffffffu, ms, i) - M);
    float wgt = lane < S ? expf(ms - M) / den : 0.f;
    float* orow = out + ((long long)t * heads + h) * d;
    // Slices in order, ATT_CJ at a time with all their loads issued before the sums.
    float acc[MAX_D / 32];
#pragma unroll
    for (int i = 0; i < MAX_D / 32; i++) acc[i] = 0.f;
#pragma unroll 1
    for (int c0 = 0; c0 < S; c0 += ATT_CJ) {
        if (c0 > 0)
#pragma unroll
            for (int u = 0; u < ATT_CJ; u++)
#pragma unroll
                for (int i = 0; i < MAX_D / 32; i++) {
                    int c = lane + 32 * i;
                    v[u][i] = c < d && c0 + u < S ? __ldcg(ph + (c0 + u) * (d + 2) + c) : 0.f;
                }
#pragma unroll
        for (int u = 0; u < ATT_CJ; u++) {
            if (c0 + u >= S) break;
            float wj = __shfl_sync(0xffffffffu, wgt, c0 + u);
#pragma unroll
            for (int i = 0; i < MAX_D / 32; i++) acc[i] += v[u][i] * wj;
        }
    }
#pragma unroll
    for (int i = 0; i < MAX_D / 32; i++) {
        int c = lane + 32 * i;
        if (c < d) orow[c] = acc[i];
    }
}

// After attention: the last min(len, rcap) rows of each segment enter the window ring.
extern "C" __global__ void ring_write(float* ring, int rcap, const float* kv, const unsigned* rows, int n, int d) {
    pdl_enter();
    GRID_STRIDE(e, (long long)n * d) {
        int t = (int)(e / d), c = (int)(e % d);
        long long i = t - (long long)ROW_START(t), len = ROW_LEN(t);
        if (i < len - min(len, (long long)rcap)) continue;
        long long p = ROW_POS(t);
        ring[((long long)ROW_SEQ(t) * rcap + p % rcap) * d + c] = kv[(long long)t * d + c];
    }
}
