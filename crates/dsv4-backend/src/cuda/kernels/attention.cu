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

// (The same with row t's segment start, its position and its sequence read once: the row
// table's loads then do not sit between each row's address and its loads.)
__device__ __forceinline__ void comp_row_at(const CompSrc& s, long long pos0, long long start, long long seq,
                                            long long q, const float** ur, const float** zr, const float** ar) {
    if (q >= pos0) {
        long long r = start + (q - pos0);
        *ur = s.u + r * s.w;
        *zr = s.z + r * s.w;
        *ar = s.ape + (q % s.m) * s.w;
    } else {
        long long o = (seq * s.k + q % s.k) * s.w;
        *ur = s.raw_u + o;
        *zr = s.raw_z + o;
        *ar = 0;
    }
}

__device__ __forceinline__ void comp_row(const CompSrc& s, const unsigned* rows, int n, int t, long long q,
                                         const float** ur, const float** zr, const float** ar) {
    comp_row_at(s, ROW_POS0(t), ROW_START(t), ROW_SEQ(t), q, ur, zr, ar);
}

// comp_pool_row's loads: CP_FAST 1 (the built-in) takes a window's rows CP_R at a time for two
// channels a thread (one round trip a CSA window; the same operations per channel, so the same
// values; call_s42d, H100: batch 1 −0.045 ms, verify 1+1..1+3 −0.11 to −0.16 ms a 32-layer
// round, PERF.md v51); 0 each row's loads after the last row's.
#ifndef CP_FAST
#define CP_FAST 1
#endif
#define CP_R 8  // rows of a pooled window a thread loads at once (comp_pool_row, CP_FAST)

// One block per batch row; rows that close a window pool it (per-channel softmax over the gate),
// RMSNorm it, rotate it at position win·m and store entry `win`. With overlap (CSA) the previous
// window's A-halves join the softmax; window 0 has none (u = 0, z = −∞: they add exactly
// nothing). Dynamic shared memory: hd floats.
// (comp_pool's body for row t, also run by comp_pool_store.)
__device__ __forceinline__ void comp_pool_row(float* entries, int cap, const float* u, const float* z,
                                              const float* raw_u, const float* raw_z, int k, const float* ape,
                                              const float* norm, const double* freqs, int npairs,
                                              const unsigned* rows, int n, int m, int hd, int overlap, float eps,
                                              int t) {
    extern __shared__ float buf[];
    __shared__ float sh[32];
    long long p = ROW_POS(t);
    if ((p + 1) % m != 0) return;
    long long win = (p + 1) / m - 1, seq = ROW_SEQ(t);
    CompSrc s = {u, z, raw_u, raw_z, ape, m, overlap ? 2 * hd : hd, k};
#if CP_FAST
    // The softmax's rows in order: with overlap and win > 0 the previous window's m rows (their
    // A-halves, columns 0..hd), then this window's m rows (columns off..off + hd). A thread takes
    // two channels, c and c + blockDim, and loads CP_R rows of both at once (gate, ape and value),
    // so a CSA window (8 rows) costs one round trip where each row's loads waited for the last
    // (16 trips a channel: ~22 µs a pooling step in a 2-row ncu table, PERF.md v51). The same
    // operations in the same order per channel: the maximum over the rows, then den and num row
    // by row.
    const int prev = overlap && win > 0 ? m : 0, nr = prev + m, off = overlap ? hd : 0;
    const long long pos0 = ROW_POS0(t), start = ROW_START(t);
    for (int c0 = threadIdx.x; c0 < hd; c0 += 2 * blockDim.x) {
        const int cc[2] = {c0, c0 + (int)blockDim.x};
        float zv[2][CP_R], uv[2][CP_R], mx[2] = {-INFINITY, -INFINITY}, den[2] = {0.f, 0.f}, num[2] = {0.f, 0.f};
        auto load = [&](int r0) {
#pragma unroll
            for (int j = 0; j < CP_R; j++) {
                int r = r0 + j;
                if (r >= nr) break;
                const float *ur, *zr, *ar;
                long long q = r < prev ? (win - 1) * m + r : win * m + (r - prev);
                comp_row_at(s, pos0, start, seq, q, &ur, &zr, &ar);
                int o = r < prev ? 0 : off;
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    int c = min(cc[h], hd - 1);  // a thread's second channel may be past hd: loaded, not used
                    zv[h][j] = ar ? zr[o + c] + ar[o + c] : zr[o + c];
                    uv[h][j] = ur[o + c];
                }
            }
        };
        for (int r0 = 0; r0 < nr; r0 += CP_R) {
            load(r0);
#pragma unroll
            for (int j = 0; j < CP_R; j++)
                if (r0 + j < nr)
#pragma unroll
                    for (int h = 0; h < 2; h++) mx[h] = fmaxf(mx[h], zv[h][j]);
        }
        for (int r0 = 0; r0 < nr; r0 += CP_R) {
            if (nr > CP_R) load(r0);  // one chunk: its values are still held
#pragma unroll
            for (int j = 0; j < CP_R; j++)
                if (r0 + j < nr)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        float e = expf(zv[h][j] - mx[h]);
                        den[h] += e;
                        num[h] += e * uv[h][j];
                    }
        }
#pragma unroll
        for (int h = 0; h < 2; h++)
            if (cc[h] < hd) buf[cc[h]] = num[h] / den[h];
    }
#else
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
#endif
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

extern "C" __global__ void comp_pool(float* entries, int cap, const float* u, const float* z, const float* raw_u,
                                     const float* raw_z, int k, const float* ape, const float* norm,
                                     const double* freqs, int npairs, const unsigned* rows, int n, int m, int hd,
                                     int overlap, float eps) {
    pdl_enter();
    comp_pool_row(entries, cap, u, z, raw_u, raw_z, k, ape, norm, freqs, npairs, rows, n, m, hd, overlap, eps,
                  blockIdx.x);
}

// comp_store's body as blocks bx of nb (of any size).
__device__ __forceinline__ void comp_store_blocks(float* raw_u, float* raw_z, int k, const float* u, const float* z,
                                                  const float* ape, const unsigned* rows, int n, int m, int w, int bx,
                                                  int nb) {
    for (long long e = bx * (long long)blockDim.x + threadIdx.x; e < (long long)n * w; e += (long long)nb * blockDim.x) {
        int t = (int)(e / w), c = (int)(e % w);
        long long p = ROW_POS(t), end = (long long)ROW_POS0(t) + ROW_LEN(t);
        if (p + k < end) continue;
        long long o = ((long long)ROW_SEQ(t) * k + p % k) * w + c;
        raw_u[o] = u[(long long)t * w + c];
        raw_z[o] = z[(long long)t * w + c] + ape[(p % m) * w + c];
    }
}

// After comp_pool: the last min(len, K) rows of each segment enter the raw ring (z + ape).
extern "C" __global__ void comp_store(float* raw_u, float* raw_z, int k, const float* u, const float* z,
                                      const float* ape, const unsigned* rows, int n, int m, int w) {
    pdl_enter();
    comp_store_blocks(raw_u, raw_z, k, u, z, ape, rows, n, m, w, blockIdx.x, gridDim.x);
}

// comp_pool (blocks 0..n) and comp_store (the rest) in one launch, for batches whose segments are
// short enough that no raw-ring row a pooling reads is one the store overwrites (the launcher
// checks: decode and verify rows). Each block runs the code of the kernel it stands for.
extern "C" __global__ void comp_pool_store(float* entries, int cap, float* raw_u, float* raw_z, int k, const float* u,
                                           const float* z, const float* ape, const float* norm, const double* freqs,
                                           int npairs, const unsigned* rows, int n, int m, int hd, int w, int overlap,
                                           float eps) {
    pdl_enter();
    if ((int)blockIdx.x < n)
        comp_pool_row(entries, cap, u, z, raw_u, raw_z, k, ape, norm, freqs, npairs, rows, n, m, hd, overlap, eps,
                      blockIdx.x);
    else
        comp_store_blocks(raw_u, raw_z, k, u, z, ape, rows, n, m, w, blockIdx.x - n, gridDim.x - n);
}

// Indexer scores: score = Σ_h w_h·ws·max(q_h·k, 0)·qs. Block (row, y); warp w takes IDX_EW
// entries at a time (group w·Y + y of IDX_EW entries, Y = gridDim.y, stepping by 8·Y groups: any
// Y works, and a grid of more than vis / (8·IDX_EW) blocks a row spreads a short row over more
// SMs with fewer busy warps each) and lane j owns
// heads j, j + 32, ...: each dot product is one chain over the channels in order (a product, then
// a sum, per channel), and one butterfly sums the heads of an entry, as in the CPU's twin order
// of old (the values are those of the previous kernel bit for bit).
// Fast path (hd a multiple of 16, hd <= 128, nh = 32, 64 or 128, 16-byte aligned q and entries):
// the queries are staged as float4 columns qc[hd/4][nh] (lane h reads a float4 of 4 channels,
// conflict-free), each warp's keys as [IDX_EW][hd] (a float4 read is a broadcast); the next
// group's keys are prefetched into registers while the current one is scored. Otherwise the
// transposed staging of old. Dynamic shared memory: (hd·(nh + 1) + 8·IDX_EW·hd + nh) floats
// (the fast path uses nh·hd + 8·IDX_EW·hd of them).
#define IDX_HPL 4  // heads a lane owns at most (nh <= 128)
#define IDX_EW 4   // entries a warp scores at a time
#define IDX_KR 4   // float4s of keys a lane prefetches (IDX_EW·hd/4 <= 32·IDX_KR: hd <= 128)
#define IDX_QB 8   // float4s of queries a thread has in flight while staging
#ifndef IDX_FMA
#define IDX_FMA 0  // 1: fused multiply-adds (half the issue; scores then round differently)
#endif
#if IDX_FMA
#define IDX_MAC(d, a, b) d = fmaf(a, b, d)
#else
#define IDX_MAC(d, a, b) d += (a) * (b)
#endif

template <int HPL>
__device__ __forceinline__ void index_score_fast(float* scores, int maxvis, const float* q, const float* wts,
                                                 const float* entries, int cap, const unsigned* rows, int n,
                                                 int nh, int hd, float qs, float ws, long long vis, float* sm) {
    int t = blockIdx.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int h4 = hd >> 2, nk4 = IDX_EW * h4;
    float4* qc = (float4*)sm;                   // [h4][nh]: q[h][4c4 .. 4c4 + 3] at c4·nh + h
    float4* kw = qc + h4 * nh + w * nk4;        // this warp's [IDX_EW][h4]
    const float4* ebase = (const float4*)entries + (long long)ROW_SEQ(t) * cap * h4;
    long long step = (long long)gridDim.y * 8 * IDX_EW;
    long long s0 = ((long long)w * gridDim.y + blockIdx.y) * IDX_EW;
    float4 kr[IDX_KR];
    auto load_keys = [&](long long s) {
        int ne4 = (int)min((long long)IDX_EW, vis - s) * h4;
        const float4* src = ebase + s * h4;
#pragma unroll
        for (int i = 0; i < IDX_KR; i++) {
            int c = lane + 32 * i;
            kr[i] = c < ne4 ? src[c] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    };
    if (s0 < vis) load_keys(s0);
    float wv[HPL];
#pragma unroll
    for (int j = 0; j < HPL; j++) wv[j] = wts[(long long)t * nh + lane + 32 * j] * ws;
    // Stage the queries: a warp moves 8 heads × 4 float4s at a time (lane = 8a + b: head 8g + b,
    // float4 4c + a), whole 32-byte sectors from global and 128 contiguous bytes a quarter-warp
    // in shared memory.
    const float4* qr = (const float4*)q + (long long)t * nh * h4;
    int nhg = nh >> 3, nchunk = nhg * (h4 >> 2);  // chunks of 32 float4s
    for (int base = 0; base < nchunk; base += IDX_QB * 8) {
        float4 v[IDX_QB];
#pragma unroll
        for (int i = 0; i < IDX_QB; i++) {
            int g = base + w + 8 * i, h = (g % nhg) * 8 + (lane & 7), c4 = (g / nhg) * 4 + (lane >> 3);
            if (g < nchunk) v[i] = qr[h * h4 + c4];
        }
#pragma unroll
        for (int i = 0; i < IDX_QB; i++) {
            int g = base + w + 8 * i, h = (g % nhg) * 8 + (lane & 7), c4 = (g / nhg) * 4 + (lane >> 3);
            if (g < nchunk) qc[c4 * nh + h] = v[i];
        }
    }
    __syncthreads();
    for (; s0 < vis; s0 += step) {
        int ne = (int)min((long long)IDX_EW, vis - s0);
        __syncwarp();
#pragma unroll
        for (int i = 0; i < IDX_KR; i++)
            if (lane + 32 * i < nk4) kw[lane + 32 * i] = kr[i];
        __syncwarp();
        if (s0 + step < vis) load_keys(s0 + step);
        float d[HPL][IDX_EW];
#pragma unroll
        for (int j = 0; j < HPL; j++)
#pragma unroll
            for (int e = 0; e < IDX_EW; e++) d[j][e] = 0.f;
        const float4* qp = qc + lane;
#pragma unroll 4
        for (int c4 = 0; c4 < h4; c4++) {
            float4 kv[IDX_EW];
#pragma unroll
            for (int e = 0; e < IDX_EW; e++) kv[e] = kw[e * h4 + c4];
#pragma unroll
            for (int j = 0; j < HPL; j++) {
                float4 qv = qp[32 * j];
#pragma unroll
                for (int e = 0; e < IDX_EW; e++) {
                    IDX_MAC(d[j][e], qv.x, kv[e].x);
                    IDX_MAC(d[j][e], qv.y, kv[e].y);
                    IDX_MAC(d[j][e], qv.z, kv[e].z);
                    IDX_MAC(d[j][e], qv.w, kv[e].w);
                }
            }
            qp += nh;
        }
#pragma unroll
        for (int e = 0; e < IDX_EW; e++) {
            float acc = 0.f;
#pragma unroll
            for (int j = 0; j < HPL; j++) acc += wv[j] * (fmaxf(d[j][e], 0.f) * qs);
            acc = warp_sum(acc);
            if (lane == 0 && e < ne) scores[(long long)t * maxvis + s0 + e] = acc;
        }
    }
}

// Any shape: the queries staged transposed (qT[c][h], rows padded to nh + 1), a float at a time.
__device__ __forceinline__ void index_score_any(float* scores, int maxvis, const float* q, const float* wts,
                                               const float* entries, int cap, const unsigned* rows, int n,
                                               int nh, int hd, float qs, float ws, long long vis, float* sm) {
    int qst = nh + 1;
    float* qT = sm;                       // [hd][nh + 1]
    float* kb = sm + hd * qst;            // [8][IDX_EW][hd]
    float* wv = kb + 8 * IDX_EW * hd;     // [nh]
    int t = blockIdx.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    long long step = (long long)gridDim.y * 8 * IDX_EW;
    const float* qr = q + (long long)t * nh * hd;
    for (int i = threadIdx.x; i < nh * hd; i += blockDim.x) qT[(i % hd) * qst + i / hd] = qr[i];
    for (int h = threadIdx.x; h < nh; h += blockDim.x) wv[h] = wts[(long long)t * nh + h] * ws;
    __syncthreads();
    float* kw = kb + w * IDX_EW * hd;
    for (long long s0 = ((long long)w * gridDim.y + blockIdx.y) * IDX_EW; s0 < vis; s0 += step) {
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
                for (int e = 0; e < IDX_EW; e++) IDX_MAC(d[j][e], qv, kc[e]);
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

// index_score's block (t, y): its share of row t's scores (none where the row has fewer entries).
__device__ __forceinline__ void index_score_block(float* scores, int maxvis, const float* q, const float* wts,
                                                  const float* entries, int cap, const unsigned* rows, int n, int m,
                                                  int nh, int hd, float qs, float ws, float* sm) {
    int t = blockIdx.x;
    long long vis = ((long long)ROW_POS(t) + 1) / m;
    if ((long long)blockIdx.y * IDX_EW >= vis) return;
    bool fast = hd % 16 == 0 && hd <= 128 && nh % 32 == 0 && (((unsigned long long)q | (unsigned long long)entries) & 15) == 0;
    if (fast && nh == 64)
        index_score_fast<2>(scores, maxvis, q, wts, entries, cap, rows, n, nh, hd, qs, ws, vis, sm);
    else if (fast && nh == 32)
        index_score_fast<1>(scores, maxvis, q, wts, entries, cap, rows, n, nh, hd, qs, ws, vis, sm);
    else if (fast && nh == 128)
        index_score_fast<4>(scores, maxvis, q, wts, entries, cap, rows, n, nh, hd, qs, ws, vis, sm);
    else
        index_score_any(scores, maxvis, q, wts, entries, cap, rows, n, nh, hd, qs, ws, vis, sm);
}

extern "C" __global__ void index_score(float* scores, int maxvis, const float* q, const float* wts,
                                       const float* entries, int cap, const unsigned* rows, int n, int m, int nh,
                                       int hd, float qs, float ws) {
    pdl_enter();
    extern __shared__ float4 sm4[];
    index_score_block(scores, maxvis, q, wts, entries, cap, rows, n, m, nh, hd, qs, ws, (float*)sm4);
}

// Order-preserving map of a float to an unsigned key (larger float, larger key).
__device__ __forceinline__ unsigned fkey(float x) {
    unsigned b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

#define TOPK_MAX 2048
#define TOPK_T 256  // threads a block (the launcher's)
#define TOPK_R 8    // keys a thread holds in registers: rows of <= TOPK_T·TOPK_R entries read the scores once

// (key, entry) as one 64-bit value: larger key first, then the lower entry. Never 0 (the padding).
__device__ __forceinline__ unsigned long long topk_pack(unsigned key, unsigned s) {
    return ((unsigned long long)key << 32) | (unsigned)~s;
}

// Exclusive prefix sum of v over the block in thread order, and the total: one barrier. `par`
// alternates between consecutive calls (the partials' buffer).
__device__ __forceinline__ unsigned topk_scan(unsigned v, unsigned* total, unsigned (*wt)[TOPK_T / 32], int par) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    unsigned inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        unsigned x = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += x;
    }
    if (lane == 31) wt[par][w] = inc;
    __syncthreads();
    unsigned before = 0, all = 0;
#pragma unroll
    for (int i = 0; i < TOPK_T / 32; i++) {
        unsigned x = wt[par][i];
        if (i < w) before += x;
        all += x;
    }
    *total = all;
    return before + inc - v;
}

// Histogram count of the (converged) warp's keys: lanes with equal digits are found with 8
// ballots and the lowest adds them all (no same-address atomics within a warp).
__device__ __forceinline__ void topk_hist(unsigned* h, bool on, unsigned digit) {
    unsigned mk = __ballot_sync(0xffffffffu, on);
    if (mk == 0) return;
#pragma unroll
    for (int b = 0; b < 8; b++) {
        unsigned x = __ballot_sync(0xffffffffu, (digit >> b) & 1u);
        mk &= ((digit >> b) & 1u) ? x : ~x;
    }
    if (on && (mk & ((1u << (threadIdx.x & 31)) - 1)) == 0) atomicAdd(&h[digit], __popc(mk));
}

// Bitonic sort (descending) of the TOPK_T·P packed values, thread i holding i·P .. i·P + P − 1:
// strides below P within a thread, below 32·P by shuffles, larger ones through shared memory
// (one barrier each). Then the first k entries to out.
template <int P>
__device__ __forceinline__ void topk_sort(unsigned long long (*buf)[TOPK_MAX], unsigned* out, int k) {
    int tid = threadIdx.x;
    unsigned long long v[P];
#pragma unroll
    for (int p = 0; p < P; p++) v[p] = tid * P + p < k ? buf[0][tid * P + p] : 0ull;
    int par = 1;
#pragma unroll
    for (int size = 2; size <= TOPK_T * P; size <<= 1) {
#pragma unroll
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            if (stride < P) {
#pragma unroll
                for (int p = 0; p < P; p++) {
                    if (p & stride) continue;
                    unsigned long long a = v[p], b = v[p | stride];
                    bool desc = ((tid * P + p) & size) == 0;
                    bool sw = desc ? a < b : a > b;
                    v[p] = sw ? b : a;
                    v[p | stride] = sw ? a : b;
                }
            } else if (stride < 32 * P) {
#pragma unroll
                for (int p = 0; p < P; p++) {
                    int e = tid * P + p;
                    unsigned long long o = __shfl_xor_sync(0xffffffffu, v[p], stride / P);
                    bool keepmax = ((e & stride) == 0) == ((e & size) == 0);
                    v[p] = keepmax == (o > v[p]) ? o : v[p];
                }
            } else {
#pragma unroll
                for (int p = 0; p < P; p++) buf[par][tid * P + p] = v[p];
                __syncthreads();
#pragma unroll
                for (int p = 0; p < P; p++) {
                    int e = tid * P + p;
                    unsigned long long o = buf[par][e ^ stride];
                    bool keepmax = ((e & stride) == 0) == ((e & size) == 0);
                    v[p] = keepmax == (o > v[p]) ? o : v[p];
                }
                par ^= 1;
            }
        }
    }
#pragma unroll
    for (int p = 0; p < P; p++)
        if (tid * P + p < k) out[tid * P + p] = ~(unsigned)v[p];
}

// Top-k per row: sel[t, j] for j < min(topk, vis): the k largest scores, ties to the lower entry
// index (the CPU's choice). O(vis) per row: (1) the k-th largest key T, a byte at a time from the
// top (a histogram of the next byte over the keys sharing the bytes found so far; every warp then
// scans it itself, so one barrier a byte), stopping early once the bin holding T is taken whole;
// (2) every key above T's bin and the bin's first keys in index order until k, placed in entry
// order (one block scan: a key's slot is the keys above the bin before it plus the bin's taken
// keys before it); (3) where `sorted` (exact mode: the CPU's order), a bitonic sort of those k,
// score descending, ties to the lower entry (packed key and entry, so the order is total and the
// result does not hang on (2)'s order). Fast mode keeps entry order: the same set, ~6 µs less a
// CSA layer at batch 1 (PERF.md v51), and a row's attention then sums its chosen entries in
// entry order, not score order (rounding only). A thread keeps
// TOPK_R consecutive keys in registers; entries past TOPK_T·TOPK_R are re-read from the scores.
// `topk` <= TOPK_MAX (checked by the launcher); blockDim.x == TOPK_T.
// (index_topk's body for row t, on buffers of the caller's: buf and hist 16-byte aligned. CG:
// the scores read through L2, for index_score_topk's last block, which reads other blocks'.)
template <bool CG>
__device__ __forceinline__ float score_ld(const float* p) {
    if constexpr (CG) return __ldcg(p);
    return *p;
}

template <bool CG>
__device__ __forceinline__ void index_topk_row(unsigned* sel, int topk, int sorted, const float* scores, int maxvis,
                                               const unsigned* rows, int n, int m, int t,
                                               unsigned long long (*buf)[TOPK_MAX], unsigned (*hist)[256],
                                               unsigned (*wt)[TOPK_T / 32]) {
    int tid = threadIdx.x, lane = tid & 31;
    int vis = (int)(((long long)ROW_POS(t) + 1) / m);
    int k = min(topk, vis);
    if (k <= 0) return;
    const float* sc = scores + (long long)t * maxvis;
    int rv = min(TOPK_R, (vis + TOPK_T - 1) / TOPK_T), nreg = TOPK_T * rv;
    unsigned key[TOPK_R];
#pragma unroll
    for (int r = 0; r < TOPK_R; r++) key[r] = r < rv && tid * rv + r < vis ? fkey(score_ld<CG>(sc + tid * rv + r)) : 0u;
    ((uint4*)hist)[tid] = make_uint4(0u, 0u, 0u, 0u);
    __syncthreads();
    unsigned thr = 0, pmask = 0, want = (unsigned)k;
#pragma unroll 1
    for (int pass = 0; pass < 4; pass++) {
        int shift = 24 - 8 * pass;
        unsigned* h = hist[pass];
#pragma unroll
        for (int r = 0; r < TOPK_R; r++) {
            bool on = r < rv && tid * rv + r < vis && (key[r] & pmask) == thr;
            topk_hist(h, on, (key[r] >> shift) & 255u);
        }
        for (int base = nreg; base < vis; base += TOPK_T) {
            int s = base + tid;
            unsigned kk = s < vis ? fkey(score_ld<CG>(sc + s)) : 0u;
            topk_hist(h, s < vis && (kk & pmask) == thr, (kk >> shift) & 255u);
        }
        __syncthreads();
        // Every warp: lane l holds bins 255 − 8l down to 248 − 8l; the bin at which the count
        // from the top reaches `want`.
        uint4 lo = ((const uint4*)h)[62 - 2 * lane], hi = ((const uint4*)h)[63 - 2 * lane];
        unsigned c[8] = {hi.w, hi.z, hi.y, hi.x, lo.w, lo.z, lo.y, lo.x}, tot = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) tot += c[i];
        unsigned inc = tot;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            unsigned x = __shfl_up_sync(0xffffffffu, inc, o);
            if (lane >= o) inc += x;
        }
        unsigned exc = inc - tot;
        int src = __ffs(__ballot_sync(0xffffffffu, exc < want && inc >= want)) - 1;
        unsigned digit = 0, above = 0, inbin = 0, cum = exc;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            if (cum < want && cum + c[i] >= want) { digit = 255u - 8u * lane - i; above = cum; inbin = c[i]; }
            cum += c[i];
        }
        digit = __shfl_sync(0xffffffffu, digit, src);
        above = __shfl_sync(0xffffffffu, above, src);
        inbin = __shfl_sync(0xffffffffu, inbin, src);
        want -= above;
        thr |= digit << shift;
        pmask |= 255u << shift;
        if (inbin == want) break;  // the whole bin is taken: no ties to break
    }
    // Keys whose masked value is above thr (k − want of them): all taken; keys in the bin: the
    // first `want` in index order. A taken key's slot: the keys above before it plus the bin's
    // taken keys before it, min(ties before it, want), so the k slots hold entry order.
    unsigned first = (unsigned)k - want, ng = 0, nt = 0;
#pragma unroll
    for (int r = 0; r < TOPK_R; r++) {
        bool ok = r < rv && tid * rv + r < vis;
        unsigned mk = key[r] & pmask;
        ng += ok && mk > thr;
        nt += ok && mk == thr;
    }
    unsigned tot;
    unsigned ex = topk_scan((ng << 16) | nt, &tot, wt, 0);
    unsigned gp = ex >> 16, tp = ex & 0xffffu;
#pragma unroll
    for (int r = 0; r < TOPK_R; r++) {
        int s = tid * rv + r;
        if (!(r < rv && s < vis)) continue;
        unsigned mk = key[r] & pmask;
        if (mk > thr) {
            buf[0][gp + min(tp, want)] = topk_pack(key[r], (unsigned)s);
            gp++;
        } else if (mk == thr) {
            if (tp < want) buf[0][gp + tp] = topk_pack(key[r], (unsigned)s);
            tp++;
        }
    }
    unsigned go = tot >> 16, to = tot & 0xffffu;
    int par = 1;
    for (int base = nreg; base < vis && (go < first || to < want); base += TOPK_T) {
        int s = base + tid;
        unsigned kk = s < vis ? fkey(score_ld<CG>(sc + s)) : 0u, mk = kk & pmask;
        bool gt = s < vis && mk > thr, tie = s < vis && mk == thr;
        unsigned e = topk_scan(((unsigned)gt << 16) | (unsigned)tie, &tot, wt, par);
        par ^= 1;
        unsigned gb = go + (e >> 16), tb = to + (e & 0xffffu);  // keys above, ties, before s
        if (gt) buf[0][gb + min(tb, want)] = topk_pack(kk, (unsigned)s);
        if (tie && tb < want) buf[0][gb + tb] = topk_pack(kk, (unsigned)s);
        go += tot >> 16;
        to += tot & 0xffffu;
    }
    __syncthreads();
    unsigned* out = sel + (long long)t * topk;
    if (!sorted) {
        for (int j = tid; j < k; j += TOPK_T) out[j] = ~(unsigned)buf[0][j];
        return;
    }
    if (k <= TOPK_T)
        topk_sort<1>(buf, out, k);
    else if (k <= 2 * TOPK_T)
        topk_sort<2>(buf, out, k);
    else if (k <= 4 * TOPK_T)
        topk_sort<4>(buf, out, k);
    else
        topk_sort<8>(buf, out, k);
}

extern "C" __global__ void index_topk(unsigned* sel, int topk, int sorted, const float* scores, int maxvis,
                                      const unsigned* rows, int n, int m) {
    pdl_enter();
    __shared__ __align__(16) unsigned long long buf[2][TOPK_MAX];
    __shared__ __align__(16) unsigned hist[4][256];
    __shared__ unsigned wt[2][TOPK_T / 32];
    index_topk_row<false>(sel, topk, sorted, scores, maxvis, rows, n, m, blockIdx.x, buf, hist, wt);
}

// index_score and index_topk in one launch (batches of short segments: decode and verify rows;
// `sorted` as index_topk's): index_score's grid (n, Y) and blocks; after its scores each block counts itself in cnt[t]
// (zeroed counters, left zero: quant.cu's quant_groups pattern), and row t's last block runs
// index_topk's body for the row on buffers carved from the dynamic shared memory the scores used
// (the launcher gives max(score bytes, TOPK_SMEM)). blockDim.x == TOPK_T.
#define TOPK_SMEM (2 * TOPK_MAX * 8 + 4 * 256 * 4 + 2 * (TOPK_T / 32) * 4)
extern "C" __global__ void index_score_topk(unsigned* sel, int topk, int sorted, unsigned* cnt, float* scores, int maxvis,
                                            const float* q, const float* wts, const float* entries, int cap,
                                            const unsigned* rows, int n, int m, int nh, int hd, float qs,
                                            float ws) {
    pdl_enter();
    extern __shared__ float4 sm4[];
    __shared__ unsigned last;
    int t = blockIdx.x;
    index_score_block(scores, maxvis, q, wts, entries, cap, rows, n, m, nh, hd, qs, ws, (float*)sm4);
    __syncthreads();  // this block's scores stored, its shared memory free again
    if (threadIdx.x == 0) {
        __threadfence();
        unsigned prev = atomicAdd(&cnt[t], 1u);
        last = prev == gridDim.y - 1;
        if (last) {
            cnt[t] = 0;  // every block of the row has counted: ready for the next launch
            __threadfence();
        }
    }
    __syncthreads();
    if (!last) return;
    char* b = (char*)sm4;
    index_topk_row<true>(sel, topk, sorted, scores, maxvis, rows, n, m, t, (unsigned long long (*)[TOPK_MAX])b,
                   (unsigned (*)[256])(b + 2 * TOPK_MAX * 8), (unsigned (*)[TOPK_T / 32])(b + 2 * TOPK_MAX * 8 + 4 * 256 * 4));
}

#define ATT_S 16   // slices a row's keys are split into at most (the grid's z)
// attention_merge's slice statistics: 1 (the built-in) a lane a slice, by warp reductions (1,056
// SASS instructions against 1,992; ncu 7.0–8.0 → 5.4–5.7 µs a launch, −0.10 ms a 32-layer H100
// step, PERF.md v50); 0 every thread forms them in slice order, att_merge_head's operations (the
// same values but for the denominator's summation order).
#ifndef ATM_WARP
#define ATM_WARP 1
#endif
static_assert(ATT_S <= 32, "attention_merge's ATM_WARP form holds a slice a lane");
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

// The merge of one (row t, head h) by one warp: the row's S slice partials at ph ((max, sum, o)
// each, d + 2 floats apart, slice order) with the sink, then the epilogue `epi` (see attention).
// The f32 kernel's last slice block runs it (attention_merge, after attention_tc's slices, forms
// the same values on more threads).
__device__ __forceinline__ void att_merge_head(float* out, const float* ph, int S, float sink, int t, int h,
                                               const unsigned* rows, int n, int heads, int d, const double* freqs,
                                               int npairs, int epi, signed char* oq, float* od) {
    int lane = threadIdx.x & 31;
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
    // Lanes past S divide 1, never read: exp(−∞ − M) = 0 there, and a zero dividend would send
    // the whole warp's division down its slow path (FCHK; the Sinkhorn's pattern, PERF.md v30).
    float wgt = (lane < S ? expf(ms - M) : 1.f) / den;
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
    if (epi & 1) {  // pair (c, c + 1) in lanes (l, l + 1) of one i
        long long pos = ROW_POS(t);
        int r0 = d - 2 * npairs;
#pragma unroll
        for (int i = 0; i < MAX_D / 32; i++) {
            int c = lane + 32 * i;
            float p = __shfl_xor_sync(0xffffffffu, acc[i], 1);
            if (c >= r0 && c < d) {
                double th = (double)pos * freqs[(c - r0) >> 1];
                th = -th;
                float sn = (float)sin(th), cs = (float)cos(th);
                acc[i] = ((c - r0) & 1) == 0 ? acc[i] * cs - p * sn : p * sn + acc[i] * cs;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < MAX_D / 32; i++) {
        int c = lane + 32 * i;
        if (c < d) orow[c] = acc[i];
    }
    if (epi & 2) {  // d a multiple of 32: value block i of the head is lanes' acc[i]
        long long base = ((long long)t * heads + h) * d;
#pragma unroll
        for (int i = 0; i < MAX_D / 32; i++) {
            if (32 * i >= d) break;
            float dd;
            oq[base + 32 * i + lane] = quant_block32(acc[i], &dd);
            if (lane == 0) od[(base >> 5) + i] = dd;
        }
    }
}

// Blocks past the rows (the last pf.layers of x) prefetch pf's weight ranges into L2 instead.
// Sink-softmax attention (values are the keys), flash-decoding style. Block (row, head group,
// slice): slice s of the row's S (see ATT_MINK) takes its keys [s·nk/S, (s+1)·nk/S) in groups of
// ATT_KG, copied (cp.async) into a ring of ATT_ST shared-memory stages: ATT_ST − 1 groups' loads
// are in flight while a group's math runs, so the slice pays about one memory latency, not one a
// tile. Its ATT_HG heads (one warp each) share each staged group; an online softmax over the
// slice leaves (max, sum, o) in `part`. The group's last slice block to finish merges the S
// partials in slice order with the sink. Rows are t0 + blockIdx.x (the launcher tiles rows so
// that `part` stays small); `done` counts finished slices per (tile row, group) and is left zero.
// epi (the merge's epilogue): bit 0, the inverse RoPE of each head's last 2·npairs channels at
// the row's position (the rope kernel's operations; this file is compiled without contraction);
// bit 1, the output's int8 codes and scales into oq / od (quant_x8's). ringw: block (row, 0, 0)
// also writes the row's kv into the ring (ring_write's rows; the launcher sets it only where the
// slots written are not among those read, i.e. every segment + window − 1 fits the ring).
extern "C" __global__ void __launch_bounds__(32 * ATT_HG, ATT_MINB) attention(float* out, float* part, unsigned* done, const float* q, const float* kv,
                                     float* ring, int win, int rcap, const float* entries, int cap, int m,
                                     const unsigned* sel, int has_sel, int topk, const float* sinks,
                                     const unsigned* rows, int n, int t0, int heads, int d, float scale,
                                     const double* freqs, int npairs, int epi, signed char* oq, float* od,
                                     int ringw, const __grid_constant__ L2Ranges pf) {
    if (l2_prefetch_block(pf, 0)) return;  // past the rows: L2 prefetch (common.cuh)
    pdl_enter();
    if (ringw && blockIdx.y == 0 && blockIdx.z == 0) {
        int t = t0 + blockIdx.x;
        long long slot = (long long)ROW_SEQ(t) * rcap + ROW_POS(t) % rcap;
        for (int c = threadIdx.x; c < d; c += blockDim.x) ring[slot * d + c] = kv[(long long)t * d + c];
    }
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
    att_merge_head(out, part + ((long long)tl * heads + h) * ATT_S * (d + 2), S, sink, t, h, rows, n, heads, d, freqs,
                   npairs, epi, oq, od);
}

// ---- Attention of many rows on tensor cores (prefill chunks): block (row, 64 heads). The 64
// heads share every key (values are the keys), so S = Q·Kᵀ (64 heads × 16 keys, k = 512) and
// O += P·V (64 × 512, k = 16 keys) are `mma.m16n8k16` products: Q, K and P rounded to bf16, f32
// sums, an online softmax per head with the sink in the denominator at the end. Warp w owns heads
// 16·(w % 4).. and O's columns 256·(w / 4)..; the two warps of a head tile each form S over half
// of d and swap their partials through shared memory with a barrier of the pair (when both formed
// the whole S, the duplicated QK product was half the tensor work: 8K prefill chunk, 4 q2 layers,
// 18.4 → 15.9 ms of attention). Keys arrive 16 at a
// time: the next tile's f32 rows are loaded into registers while the current one's math runs,
// then rounded and stored into the other shared buffer. Dynamic shared memory: ATC_SMEM bytes.
#define ATC_H 64       // heads a block (attention_tc; attention_tcd: 16)
#define ATC_KT 16      // keys a tile
#define ATC_LD 520     // bf16 a shared row: 512 + 8 (ldmatrix rows on 8 distinct bank groups)
#define ATC_SMEM_OF(HB) (((HB) + 2 * ATC_KT) * ATC_LD * 2)
#define ATC_SMEM ATC_SMEM_OF(ATC_H)
#define ATC_SELMAX 2048  // selected entries a row kept in shared memory (more: read from global)
#ifndef ATC_MINT
#define ATC_MINT 2  // key tiles a slice takes at least (decode-sized calls, see attention_tc's slices)
#endif

// Key slices of a row of `ntiles` key tiles: at least ATC_MINT tiles each, at most zs (and
// ATT_S, the partials' room a head).
__device__ __forceinline__ int atc_slices(int ntiles, int zs) {
    return min(min(zs, ATT_S), max(1, (ntiles + ATC_MINT - 1) / ATC_MINT));
}

// The body of attention_tc (HB = ATC_H: 64 heads a block) and attention_tcd (HB = 16, decode
// slices only): MI = HB / 16 head tiles, each formed by NP = 8 / MI warps that split d into spans
// of 512 / NP channels (64 heads: 2 warps of 256; 16 heads: 8 warps of 64). A warp's S partials
// are summed over its tile's NP warps in span order, so HB = 64 keeps attention_tc's bits. With
// 16 heads a block, a decode slice loads a quarter of the queries, writes a quarter of the
// partials and carries a quarter of the QK / PV products a warp, on 4× the blocks (PERF.md v49:
// a 64-head slice block was a fixed ~15 µs chain of ~2,200 instructions a warp).
template <int HB>
__device__ __forceinline__ void attention_tc_body(float* out, const float* q, const float* kv, const float* ring,
                                                  int win, int rcap, const float* entries, int cap, int m,
                                                  const unsigned* sel, int has_sel, int topk, const float* sinks,
                                                  const unsigned* rows, int n, int heads, float* part, int t0) {
    constexpr int MI = HB / 16, NP = 8 / MI, SPAN = 512 / NP, NJ = SPAN / 8;
    const int d = 512;
    extern __shared__ __align__(16) unsigned short atc_sm[];
    unsigned short* Qs = atc_sm;                // [HB][ATC_LD]
    unsigned short* Ks = atc_sm + HB * ATC_LD;  // [2][ATC_KT][ATC_LD]
    __shared__ float atc_sx[8][8][32];          // each warp's partial S (16 heads × 16 keys)
    int tl = blockIdx.x, t = t0 + tl, h0 = blockIdx.y * HB;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
    int mi = warp % MI, nh = warp / MI;
    long long p = ROW_POS(t);
    long long lo = p + 1 > win ? p + 1 - win : 0;
    int nwin = (int)(p - lo + 1), ncomp = 0;
    if (m > 0) {
        int vis = (int)((p + 1) / m);
        ncomp = has_sel ? min(topk, vis) : vis;
    }
    int nk = nwin + ncomp, ntiles = (nk + ATC_KT - 1) / ATC_KT;
    // Key slices (decode-sized calls, gridDim.z > 1): slice s of the row's S takes tiles
    // [s·ntiles/S, (s+1)·ntiles/S) and leaves each head's (max, sum, o) in `part` for
    // attention_merge. S is a function of the row alone (at least ATC_MINT tiles a slice), so the
    // row's sums never depend on its batch; a slice's first tile holds a live key.
    const int S = gridDim.z == 1 ? 1 : atc_slices(ntiles, gridDim.z), sl = blockIdx.z;
    if (sl >= S) return;  // block-uniform, before any barrier
    int tb = (int)((long long)ntiles * sl / S), te = (int)((long long)ntiles * (sl + 1) / S);
    // The block's HB heads' queries, rounded to bf16: up to 16 loads a thread in flight at once
    // (64 heads: two round trips; 16 heads: one of 8 loads).
    constexpr int QU = HB * 512 / 4 / 256 < 16 ? HB * 512 / 4 / 256 : 16;
    const float* qr = q + ((long long)t * heads + h0) * d;
    for (int i0 = tid; i0 < HB * d / 4; i0 += QU * 256) {
        float4 v[QU];
#pragma unroll
        for (int u = 0; u < QU; u++) v[u] = *(const float4*)(qr + 4 * (i0 + 256 * u));
#pragma unroll
        for (int u = 0; u < QU; u++) {
            int i = i0 + 256 * u, hh = i / (d / 4), c = 4 * (i % (d / 4));
            *(uint2*)(Qs + hh * ATC_LD + c) = make_uint2(bf2(v[u].x, v[u].y), bf2(v[u].z, v[u].w));
        }
    }
    // Key addresses without a dependent load in the tile loop: the row's table entries in
    // registers, its window's first ring slot, and its selected entries' indices in shared memory
    // (one coalesced read here, where att_key read the index and then the key every tile).
    long long seq = ROW_SEQ(t), pos0 = ROW_POS0(t), start = ROW_START(t);
    int lo_slot = rcap > 0 ? (int)(lo % rcap) : 0;
    __shared__ unsigned atc_sel[ATC_SELMAX];
    bool sel_sm = has_sel && ncomp <= ATC_SELMAX;
    if (sel_sm)  // the entries of this slice's tiles (all of them unsliced)
        for (int i = max(0, tb * ATC_KT - nwin) + tid; i < min(ncomp, te * ATC_KT - nwin); i += 256)
            atc_sel[i] = sel[(long long)t * topk + i];
    auto key = [&](int j) -> const float* {
        if (j < nwin) {
            long long pp = lo + j;
            if (pp < pos0) {
                int slot = lo_slot + j;  // j < nwin <= win <= rcap
                if (slot >= rcap) slot -= rcap;
                return ring + (seq * rcap + slot) * d;
            }
            return kv + (start + (pp - pos0)) * d;
        }
        long long e = !has_sel ? (long long)(j - nwin) : sel_sm ? (long long)atc_sel[j - nwin]
                                                                : (long long)sel[(long long)t * topk + (j - nwin)];
        return entries + (seq * cap + e) * d;
    };
    __syncthreads();
    // Key staging: thread tid takes key tid / 16 of a tile, float4s at 4·(tid % 16) + 64·i.
    int sk = tid >> 4, sc = 4 * (tid & 15);
    float4 kr[8];
    auto load = [&](int tile) {
        int j = tile * ATC_KT + sk;
        if (j < nk) {
            const float* kp = key(j);
#pragma unroll
            for (int i = 0; i < 8; i++) kr[i] = *(const float4*)(kp + sc + 64 * i);
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) kr[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    };
    auto store = [&](int buf) {
        unsigned short* kb = Ks + (buf * ATC_KT + sk) * ATC_LD;
#pragma unroll
        for (int i = 0; i < 8; i++)
            *(uint2*)(kb + sc + 64 * i) = make_uint2(bf2(kr[i].x, kr[i].y), bf2(kr[i].z, kr[i].w));
    };
    float o[NJ][4];
#pragma unroll
    for (int j = 0; j < NJ; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[j][e] = 0.f;
    float mx[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // rows g and g + 8 of the warp's tile
    const float scale = rsqrtf((float)d);
    load(tb);
    store(0);
    __syncthreads();
#pragma unroll 1
    for (int tile = tb; tile < te; tile++) {
        int buf = (tile - tb) & 1;
        if (tile + 1 < te) load(tile + 1);
        const unsigned short* kb = Ks + buf * ATC_KT * ATC_LD;
        // S (16 heads × 16 keys: two n-tiles of 8) in steps of 16 channels. The NP warps of head
        // tile mi split d: each forms S over its SPAN channels in two accumulator chains, then
        // they swap partials through shared memory, each summing all NP in span order (so every
        // warp of the tile holds the same bits).
        float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        float s2[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll 4
        for (int kk = SPAN * nh; kk < SPAN * nh + SPAN; kk += 32) {
            unsigned a[4], bb[4], a2[4], b2[4];
            ldsm_x4(a, Qs + (16 * mi + (lane & 15)) * ATC_LD + kk + (lane >> 4) * 8);
            ldsm_x4(bb, kb + ((lane & 7) + ((lane >> 4) << 3)) * ATC_LD + kk + ((lane >> 3) & 1) * 8);
            ldsm_x4(a2, Qs + (16 * mi + (lane & 15)) * ATC_LD + kk + 16 + (lane >> 4) * 8);
            ldsm_x4(b2, kb + ((lane & 7) + ((lane >> 4) << 3)) * ATC_LD + kk + 16 + ((lane >> 3) & 1) * 8);
            mma_bf16_16816(s[0], a, bb[0], bb[1]);
            mma_bf16_16816(s[1], a, bb[2], bb[3]);
            mma_bf16_16816(s2[0], a2, b2[0], b2[1]);
            mma_bf16_16816(s2[1], a2, b2[2], b2[3]);
        }
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                s[j][e] += s2[j][e];
                atc_sx[warp][4 * j + e][lane] = s[j][e];
            }
        if constexpr (NP == 8) {
            // One tile a block: warp w sums the 8 partials of S's slot w (the same order, u = 0..7)
            // into atc_sx[0][w], then every warp reads the sums (16 shared loads a lane, not 64).
            __syncthreads();
            float acc = atc_sx[0][warp][lane];
#pragma unroll
            for (int u = 1; u < NP; u++) acc += atc_sx[u][warp][lane];
            atc_sx[0][warp][lane] = acc;
            __syncthreads();
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[j][e] = atc_sx[0][4 * j + e][lane];
        } else {
            asm volatile("bar.sync %0, %1;" ::"r"(1 + mi), "r"(32 * NP) : "memory");
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float acc = atc_sx[mi][4 * j + e][lane];
#pragma unroll
                    for (int u = 1; u < NP; u++) acc += atc_sx[mi + MI * u][4 * j + e][lane];
                    s[j][e] = acc;
                }
        }
        // Online softmax: this thread's values are rows g (e = 0, 1) and g + 8 (e = 2, 3), keys
        // 8·j + 2·tq + (e & 1); keys past nk are −∞.
        float nm[2] = {mx[0], mx[1]};
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int key = tile * ATC_KT + 8 * j + 2 * tq + (e & 1);
                float v = key < nk ? s[j][e] * scale : -INFINITY;
                s[j][e] = v;
                nm[e >> 1] = fmaxf(nm[e >> 1], v);
            }
#pragma unroll
        for (int r = 0; r < 2; r++) {
            nm[r] = fmaxf(nm[r], __shfl_xor_sync(0xffffffffu, nm[r], 1));
            nm[r] = fmaxf(nm[r], __shfl_xor_sync(0xffffffffu, nm[r], 2));
        }
        // A tile holds at least one live key, so nm is finite.
        float corr[2] = {expf(mx[0] - nm[0]), expf(mx[1] - nm[1])};
        unsigned pa[4];
        float pv[2][4];
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) pv[j][e] = expf(s[j][e] - nm[e >> 1]);
#pragma unroll
        for (int r = 0; r < 2; r++) {
            l[r] = l[r] * corr[r] + pv[0][2 * r] + pv[0][2 * r + 1] + pv[1][2 * r] + pv[1][2 * r + 1];
            mx[r] = nm[r];
        }
        // P as the A operand (rows g / g + 8, keys 2tq.. of n-tile 0 and 8 + 2tq.. of n-tile 1).
        pa[0] = bf2(pv[0][0], pv[0][1]);
        pa[1] = bf2(pv[0][2], pv[0][3]);
        pa[2] = bf2(pv[1][0], pv[1][1]);
        pa[3] = bf2(pv[1][2], pv[1][3]);
        // Once a row's maximum settles (most tiles of a long row) nothing needs rescaling.
        if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f))
#pragma unroll
            for (int j = 0; j < NJ; j++) {
                o[j][0] *= corr[0];
                o[j][1] *= corr[0];
                o[j][2] *= corr[1];
                o[j][3] *= corr[1];
            }
        // O[:, SPAN·nh + 8j ..] += P · V: V = the keys, B fragments by transposed ldmatrix.
#pragma unroll
        for (int j = 0; j < NJ; j += 2) {
            unsigned bb[4];
            ldsm_x4_t(bb, kb + ((lane & 7) + ((lane >> 3) & 1) * 8) * ATC_LD + SPAN * nh + 8 * j + (lane >> 4) * 8);
            mma_bf16_16816(o[j], pa, bb[0], bb[1]);
            mma_bf16_16816(o[j + 1], pa, bb[2], bb[3]);
        }
        if (tile + 1 < te) store(buf ^ 1);
        __syncthreads();
    }
    // The sink joins the denominator: o / (l + exp(sink − m)), both scaled by exp(m − M).
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    if (gridDim.z > 1) {  // the slice's partials, in the f32 kernel's layout (ATT_S slices a head)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            int hh = h0 + 16 * mi + g + 8 * r;
            float* pr = part + (((long long)tl * heads + hh) * ATT_S + sl) * (d + 2);
#pragma unroll
            for (int j = 0; j < NJ; j++)
                *(float2*)(pr + SPAN * nh + 8 * j + 2 * tq) = make_float2(o[j][2 * r], o[j][2 * r + 1]);
            if (nh == 0 && tq == 0) {
                pr[d] = mx[r];
                pr[d + 1] = l[r];
            }
        }
        return;
    }
    float w[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int hh = h0 + 16 * mi + g + 8 * r;
        float sink = sinks[hh], M = fmaxf(mx[r], sink);
        float f = expf(mx[r] - M);
        w[r] = f / (l[r] * f + expf(sink - M));
    }
#pragma unroll
    for (int j = 0; j < NJ; j++) {
        int c = SPAN * nh + 8 * j + 2 * tq;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            int hh = h0 + 16 * mi + g + 8 * r;
            *(float2*)(out + ((long long)t * heads + hh) * d + c) = make_float2(o[j][2 * r] * w[r], o[j][2 * r + 1] * w[r]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(256, 1)
    attention_tc(float* out, const float* q, const float* kv, const float* ring, int win, int rcap,
                 const float* entries, int cap, int m, const unsigned* sel, int has_sel, int topk,
                 const float* sinks, const unsigned* rows, int n, int heads, float* part, int t0,
                 const __grid_constant__ L2Ranges pf) {
    if (l2_prefetch_block(pf, 0)) return;  // past the rows: L2 prefetch (common.cuh)
    pdl_enter();
    attention_tc_body<ATC_H>(out, q, kv, ring, win, rcap, entries, cap, m, sel, has_sel, topk, sinks, rows, n, heads,
                             part, t0);
}

// attention_tc at 16 heads a block (decode slices, `DSV4_ATT_TC_HEADS=16`): grid (rows, heads / 16,
// slices), dynamic shared memory ATC_SMEM_OF(16).
extern "C" __global__ void __launch_bounds__(256, 2)
    attention_tcd(float* out, const float* q, const float* kv, const float* ring, int win, int rcap,
                  const float* entries, int cap, int m, const unsigned* sel, int has_sel, int topk,
                  const float* sinks, const unsigned* rows, int n, int heads, float* part, int t0,
                  const __grid_constant__ L2Ranges pf) {
    if (l2_prefetch_block(pf, 0)) return;
    pdl_enter();
    attention_tc_body<16>(out, q, kv, ring, win, rcap, entries, cap, m, sel, has_sel, topk, sinks, rows, n, heads,
                          part, t0);
}

// attention_tc's key slices merged (decode-sized calls): block (row, head), thread i taking
// columns 2i and 2i + 1 (blockDim ≥ d / 2). Each warp forms the maximum, denominator and slice
// weights (ATM_WARP 1: a lane a slice; 0: every thread, att_merge_head's operations in its
// order), and each thread adds its columns' slice values in slice order; the inverse RoPE's pairs are a thread's two
// columns; a 32-column block's int8 codes are quant_block32's over 16 threads (the maximum is
// exact whatever the order, and any NaN or ±∞ in the block gives codes 0 and scale NaN). A warp a
// head over ATT_HG-head blocks left ~8 SMs busy at batch 1 and took ~15–22 µs (PERF.md v26); here
// every slice value of the (row, head) is loaded at once, on heads × rows blocks. ringw: block
// (row, head 0) writes the row's kv into the ring, after every slice has read the ring.
extern "C" __global__ void __launch_bounds__(MAX_D / 2) attention_merge(float* out, const float* part, float* ring,
                                                                       const float* kv, int win, int rcap, int m,
                                                                       int has_sel, int topk, const float* sinks,
                                                                       const unsigned* rows, int n, int t0, int heads,
                                                                       int d, const double* freqs, int npairs,
                                                                       int epi, signed char* oq, float* od,
                                                                       int ringw, int zs) {
    pdl_enter();
    int t = t0 + blockIdx.x, h = blockIdx.y, c = 2 * threadIdx.x;
    if (ringw && h == 0) {
        long long slot = (long long)ROW_SEQ(t) * rcap + ROW_POS(t) % rcap;
        for (int j = threadIdx.x; j < d; j += blockDim.x) ring[slot * d + j] = kv[(long long)t * d + j];
    }
    long long p = ROW_POS(t);
    long long lo = p + 1 > win ? p + 1 - win : 0;
    int nk = (int)(p - lo + 1);
    if (m > 0) {
        int vis = (int)((p + 1) / m);
        nk += has_sel ? min(topk, vis) : vis;
    }
    const int S = atc_slices((nk + ATC_KT - 1) / ATC_KT, zs);
    const float* ph = part + ((long long)blockIdx.x * heads + h) * ATT_S * (d + 2);
    bool in = c < d;  // d even: a thread's two columns are both in or both out
    // Every load at once: the slices' two values of this thread (8-byte aligned: d + 2 even) and
    // their statistics (the same addresses in every thread).
    float2 v[ATT_S];
#if ATM_WARP
#pragma unroll
    for (int u = 0; u < ATT_S; u++)
        v[u] = u < S && in ? __ldcg((const float2*)(ph + u * (d + 2) + c)) : make_float2(0.f, 0.f);
    float sink = sinks[h];
    // Lane u holds slice u's statistics: the maximum and the denominator by warp reductions, one
    // exponential and one division a lane, and each slice's weight then read from its lane.
    int lane = threadIdx.x & 31;
    float mu = lane < S ? __ldcg(ph + lane * (d + 2) + d) : -INFINITY;
    float lu = lane < S ? __ldcg(ph + lane * (d + 2) + d + 1) : 0.f;
    float M = fmaxf(sink, mu);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    float eu = lane < S ? expf(mu - M) : 0.f, su = lu * eu;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) su += __shfl_xor_sync(0xffffffffu, su, o);
    float wu = eu / (expf(sink - M) + su);
    float a0 = 0.f, a1 = 0.f;
#pragma unroll
    for (int u = 0; u < ATT_S; u++) {
        float wj = __shfl_sync(0xffffffffu, wu, u);
        if (u < S) {
            a0 += v[u].x * wj;
            a1 += v[u].y * wj;
        }
    }
#else
    float ms[ATT_S], ls[ATT_S];
#pragma unroll
    for (int u = 0; u < ATT_S; u++) {
        bool on = u < S;
        v[u] = on && in ? __ldcg((const float2*)(ph + u * (d + 2) + c)) : make_float2(0.f, 0.f);
        ms[u] = on ? __ldcg(ph + u * (d + 2) + d) : -INFINITY;
        ls[u] = on ? __ldcg(ph + u * (d + 2) + d + 1) : 0.f;
    }
    float sink = sinks[h];
    float M = sink;
#pragma unroll
    for (int u = 0; u < ATT_S; u++)
        if (u < S) M = fmaxf(M, ms[u]);
    float den = expf(sink - M);
#pragma unroll
    for (int u = 0; u < ATT_S; u++)
        if (u < S) den += ls[u] * expf(ms[u] - M);
    float a0 = 0.f, a1 = 0.f;
#pragma unroll
    for (int u = 0; u < ATT_S; u++)
        if (u < S) {
            float wj = expf(ms[u] - M) / den;
            a0 += v[u].x * wj;
            a1 += v[u].y * wj;
        }
#endif
    if (epi & 1) {  // the pair (c, c + 1): r0 = d − 2·npairs is even
        int r0 = d - 2 * npairs;
        if (in && c >= r0) {
            double th = (double)p * freqs[(c - r0) >> 1];
            th = -th;
            float sn = (float)sin(th), cs = (float)cos(th);
            float e0 = a0 * cs - a1 * sn, e1 = a0 * sn + a1 * cs;
            a0 = e0;
            a1 = e1;
        }
    }
    long long base = ((long long)t * heads + h) * d;
    if (in) *(float2*)(out + base + c) = make_float2(a0, a1);
    if (epi & 2) {  // d a multiple of 32: the 16 threads of a half warp hold one block
        float mx = fmaxf(fabsf(a0), fabsf(a1));
        int bad = !(fabsf(a0) <= 3.402823466e38f) || !(fabsf(a1) <= 3.402823466e38f);
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) {
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            bad |= __shfl_xor_sync(0xffffffffu, bad, o);
        }
        float dd = __fdiv_rn(mx, 127.f);
        float id = dd != 0.f ? __fdiv_rn(1.f, dd) : 0.f;
        int q0 = bad ? 0 : (int)roundf(__fmul_rn(a0, id)), q1 = bad ? 0 : (int)roundf(__fmul_rn(a1, id));
        if (in) {
            oq[base + c] = (signed char)max(-127, min(127, q0));
            oq[base + c + 1] = (signed char)max(-127, min(127, q1));
            if ((threadIdx.x & 15) == 0) od[(base + c) >> 5] = bad ? __int_as_float(0x7fc00000) : dd;
        }
    }
}

// ---- Indexer scores of many rows on tensor cores (prefill chunks; V4-Flash's indexer of 64
// heads × 128). Per row t the dot products are Q_t (64 heads × 128) · Eᵀ (128 × entries): the
// heads are the mma's M. A sequence's entries are shared by all its rows, so a block takes
// ITC_R consecutive rows and streams ITC_NT entries at a time through shared memory (rounded to
// bf16, double-buffered: the next tile's f32 rows are loaded into registers while the current
// one's products run), each tile read once a block rather than once a row (8 rows: 16 bytes of
// L2 traffic an entry and row instead of 512). Warp w owns row w: its 64 heads (four m-tiles)
// against the tile's 64 entries (eight n-tiles), so a row's head sum stays in the warp: each
// thread sums its 8 heads (m-tiles × rows g / g + 8), then a 3-level reduce-scatter over g (lane
// bits 2..4) leaves lane (g, tq) the sums of entries 8·g + 2·tq and 8·g + 2·tq + 1. Q and E are
// rounded to bf16 (2^-9 relative each), the sums are f32; score = Σ_h (w_h·ws·qs)·max(q_h·e, 0)
// (qs > 0 moves into the weight). Rows of different sequences in one block (segment edges,
// decode rows) are taken in passes, one sequence each; entries past a row's visible count are
// not written. Blocks run in reverse row order: a sequence's later rows see more entries, so the
// longest blocks start first and the short ones fill the tail. Dynamic shared memory: ITC_SMEM
// bytes.
#define ITC_R 8        // rows a block (a warp each)
#define ITC_NH 64      // heads
#define ITC_HD 128     // channels a head
#define ITC_NT 64      // entries a tile
#define ITC_LD 136     // bf16 a shared row: 128 + 8 (ldmatrix rows on 8 distinct bank groups)
#define ITC_SMEM ((ITC_R * ITC_NH + 2 * ITC_NT) * ITC_LD * 2)

// One level of index_score_tc's reduce-scatter: of v[0 .. 2W) the lane keeps the upper half
// (hi) or the lower, adds the partner lane's (lane ^ x) copy of the same half, and leaves the
// sums in v[0 .. W).
template <int W>
__device__ __forceinline__ void itc_keep_half(float* v, bool hi, int x) {
#pragma unroll
    for (int i = 0; i < W; i++) {
        float send = hi ? v[i] : v[i + W], keep = hi ? v[i + W] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, x);
    }
}

extern "C" __global__ void __launch_bounds__(256, 1)
    index_score_tc(float* scores, int maxvis, const float* q, const float* wts, const float* entries, int cap,
                   const unsigned* rows, int n, int m, float qs, float ws) {
    pdl_enter();
    extern __shared__ __align__(16) unsigned short itc_sm[];
    unsigned short* Qs = itc_sm;                            // [ITC_R · ITC_NH][ITC_LD]
    unsigned short* Es = itc_sm + ITC_R * ITC_NH * ITC_LD;  // [2][ITC_NT][ITC_LD]
    int t0 = (gridDim.x - 1 - blockIdx.x) * ITC_R, nrow = min(ITC_R, n - t0);
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
    int t = t0 + warp;
    bool has = warp < nrow;
    int vis = has ? (int)(ROW_POS(t) + 1) / m : 0;
    // The block's rows' queries, rounded to bf16 (rows past n: zeros, never scored); 8 float4s
    // of a thread in flight at a time (one block an SM: nothing else hides this load).
    const float4* qr = (const float4*)(q + (long long)t0 * ITC_NH * ITC_HD);
#pragma unroll 1
    for (int i0 = tid; i0 < ITC_R * ITC_NH * ITC_HD / 4; i0 += 8 * 256) {
        float4 v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            int i = i0 + 256 * u;
            v[u] = i / (ITC_NH * ITC_HD / 4) < nrow ? qr[i] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < 8; u++) {
            int i = i0 + 256 * u, hh = i / (ITC_HD / 4), c = 4 * (i % (ITC_HD / 4));
            *(uint2*)(Qs + hh * ITC_LD + c) = make_uint2(bf2(v[u].x, v[u].y), bf2(v[u].z, v[u].w));
        }
    }
    // This thread's heads 16·mt + g + 8·rr, their weights with both scales.
    float wq[4][2];
#pragma unroll
    for (int mt = 0; mt < 4; mt++)
#pragma unroll
        for (int rr = 0; rr < 2; rr++)
            wq[mt][rr] = has ? wts[(long long)t * ITC_NH + 16 * mt + g + 8 * rr] * ws * qs : 0.f;
    // Entry staging: warp w takes entries 8·w .. 8·w + 7 of a tile, lane the float4 at 4·lane
    // (a warp's load is one entry's 512 contiguous bytes).
    float4 er[8];
    unsigned todo = (1u << nrow) - 1;
    while (todo) {
        // One pass: the rows of the first pending row's sequence, over the tiles up to their
        // largest visible count (rows of a segment are contiguous: mostly one pass a block).
        unsigned seq = ROW_SEQ(t0 + __ffs(todo) - 1), act = 0;
        int bvis = 0;
        for (int i = 0; i < nrow; i++)
            if (((todo >> i) & 1) && ROW_SEQ(t0 + i) == seq) {
                act |= 1u << i;
                bvis = max(bvis, (int)(ROW_POS(t0 + i) + 1) / m);
            }
        todo &= ~act;
        bool live = has && ((act >> warp) & 1);
        int ntiles = (bvis + ITC_NT - 1) / ITC_NT;
        if (ntiles == 0) continue;
        const float* ebase = entries + ((long long)seq * cap + 8 * warp) * ITC_HD + 4 * lane;
        auto load = [&](int tile) {
            int j0 = tile * ITC_NT + 8 * warp;
            const float* src = ebase + (long long)tile * ITC_NT * ITC_HD;
#pragma unroll
            for (int i = 0; i < 8; i++)
                er[i] = j0 + i < bvis ? *(const float4*)(src + i * ITC_HD) : make_float4(0.f, 0.f, 0.f, 0.f);
        };
        auto store = [&](int buf) {
            unsigned short* dst = Es + (buf * ITC_NT + 8 * warp) * ITC_LD + 4 * lane;
#pragma unroll
            for (int i = 0; i < 8; i++)
                *(uint2*)(dst + i * ITC_LD) = make_uint2(bf2(er[i].x, er[i].y), bf2(er[i].z, er[i].w));
        };
        load(0);
        store(0);
        __syncthreads();  // the queries (first pass) and tile 0 are staged
#pragma unroll 1
        for (int tile = 0; tile < ntiles; tile++) {
            int buf = tile & 1, e0 = tile * ITC_NT;
            if (tile + 1 < ntiles) load(tile + 1);
            if (live && e0 < vis) {
                const unsigned short* qb = Qs + (warp * ITC_NH + (lane & 15)) * ITC_LD + (lane >> 4) * 8;
                const unsigned short* eb =
                    Es + (buf * ITC_NT + (lane & 7) + ((lane >> 4) << 3)) * ITC_LD + ((lane >> 3) & 1) * 8;
                float s[4][8][4];
#pragma unroll
                for (int mt = 0; mt < 4; mt++)
#pragma unroll
                    for (int nt = 0; nt < 8; nt++)
#pragma unroll
                        for (int e = 0; e < 4; e++) s[mt][nt][e] = 0.f;
#pragma unroll
                for (int kk = 0; kk < ITC_HD; kk += 16) {
                    unsigned b[4][4];  // b[p]: n-tiles 2p (regs 0, 1) and 2p + 1 (regs 2, 3)
#pragma unroll
                    for (int p = 0; p < 4; p++) ldsm_x4(b[p], eb + 16 * p * ITC_LD + kk);
#pragma unroll
                    for (int mt = 0; mt < 4; mt++) {
                        unsigned a[4];
                        ldsm_x4(a, qb + 16 * mt * ITC_LD + kk);
#pragma unroll
                        for (int nt = 0; nt < 8; nt++)
                            mma_bf16_16816(s[mt][nt], a, b[nt >> 1][2 * (nt & 1)], b[nt >> 1][2 * (nt & 1) + 1]);
                    }
                }
                // v[2·nt + c]: entry 8·nt + 2·tq + c, summed over this thread's 8 heads
                // (accumulator e = 2·rr + c).
                float v[16];
#pragma unroll
                for (int nt = 0; nt < 8; nt++)
#pragma unroll
                    for (int c = 0; c < 2; c++) {
                        float acc = 0.f;
#pragma unroll
                        for (int mt = 0; mt < 4; mt++)
#pragma unroll
                            for (int rr = 0; rr < 2; rr++)
                                acc = fmaf(wq[mt][rr], fmaxf(s[mt][nt][2 * rr + c], 0.f), acc);
                        v[2 * nt + c] = acc;
                    }
                // Reduce-scatter over g: at each level a lane keeps the half of its values its g
                // bit selects and adds its partner's copy of that half; lane (g, tq) ends with
                // v[2·g], v[2·g + 1] summed over all 64 heads.
                itc_keep_half<8>(v, (g >> 2) & 1, 16);
                itc_keep_half<4>(v, (g >> 1) & 1, 8);
                itc_keep_half<2>(v, g & 1, 4);
                int j = e0 + 8 * g + 2 * tq;
                float* out = scores + (long long)t * maxvis + j;
                if (j < vis) out[0] = v[0];
                if (j + 1 < vis) out[1] = v[1];
            }
            if (tile + 1 < ntiles) store(buf ^ 1);
            __syncthreads();
        }
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
