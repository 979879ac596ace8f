// Packed weights used in place: GGUF Q8_0 / Q4_K / Q2_K / IQ2_XXS blocks and the official FP8
// (128×128 f32 block scales) and FP4 (per-32 UE8M0 scales) formats, dequantised inside the
// kernels. Launchers: cuda/quant.rs. CPU references: dsv4_model::quant::dequant_* (the
// `deq8_*` functions below follow them operation for operation, with explicit round-to-nearest
// intrinsics so that FMA contraction cannot change a dequantised value).
//
// Every kernel works on 8 consecutive values of a row at a time (`c` a multiple of 8): one
// warp per output row, lane i taking columns 8i, 8i+256, ... — a warp walks a row's blocks
// in order. The GGUF formats are held as two planes (dsv4_model::packed::Planes, split by the
// uploader): `w` the blocks' codes, `row_bytes(k)` a row, and `s` the rest of each block (d,
// dmin, sub-block scales), `head_bytes(k)` a row — so a lane loads its codes in one aligned
// 8- or 16-byte load. The table IQ2XXS_SEL is prepended by the launcher, formed from the CPU
// decoder's grid (x8.rs `iq2_tables_source`).

#define F_Q8_0 0
#define F_Q4_K 1
#define F_Q2_K 2
#define F_IQ2_XXS 3
#define F_FP8 4
#define F_FP4 5
#define F_BF16 6  // a bf16 matrix beside packed ones (an expert whose w2 rows are not whole blocks)

typedef unsigned char u8;
typedef unsigned short u16;

// IQ2_XXS's grid as the decode reads it (IQ2XXS_SEL: each entry's two quads as byte-permute
// selectors, see iq2_quad): a copy in shared memory in the kernels (fill_tabs at each kernel's
// start), where a warp's 32 lanes index it at scattered places (from global memory through L1
// such a load costs up to one wavefront per 128-byte line it touches, ~14 for the 2 KB table);
// the global itself in the host build of tests/quant_host.rs. The sign tables are not read: the
// planes hold every sign (iq2_quad).
//
// The warp kernels' int8 decode (xdec32: fill_tabs<F, true>) can read SEL_COPIES interleaved
// copies (entry i's copy j at 8-byte slot SEL_COPIES·i + j), a lane its copy j = lane mod
// SEL_COPIES. A 64-bit shared load is served a half warp at a time, and with one copy its 16
// lanes' random entries hit a bank pair ~3 times (ncu: 5.7 wavefronts a warp's lookup, 65 % of
// moe_up1s's shared wavefronts; PERF.md v26); with 16 copies each lane of a half warp has its
// own bank pair (2 wavefronts). Measured (PERF.md v28, H100, 4 q2 layers): 16 copies +2 % a
// batch-16 step (every block fills 32 KB: ~650 MB of shared stores a layer for ~350 MB of
// weights), 8 copies −2 % (within the noise), batch 1 unchanged; so one copy by default. The
// int8 tensor-core tiles (tdec) and prefill's dequantising tiles (deq8r) always keep one copy
// (fill_tabs<F, false>): their own 16–32 KB of shared memory plus 32 KB would pass the 48 KB
// of static shared memory a kernel may declare, and the module would fail to load.
#ifndef SEL_COPIES
#define SEL_COPIES 1
#endif
static_assert(SEL_COPIES >= 1 && SEL_COPIES <= 16 && (SEL_COPIES & (SEL_COPIES - 1)) == 0,
              "SEL_COPIES: a power of two (the lane mask), at most 16 (32 KB)");
#ifdef __CUDACC_RTC__
__shared__ unsigned long long S_SEL[256];
__shared__ __align__(16) unsigned long long S_SELX[256 * SEL_COPIES];
#define TAB_SEL(i) S_SEL[i]
// The address as the lane's copy (a shared-window address, formed once) plus i·8·SEL_COPIES: one
// IMAD a lookup. (As an index ptxas spent two, the second adding the window base, which on sm_90
// is not a constant: it holds the block's place in its cluster.) Volatile, so that the load
// stays after fill_tabs's barrier.
__device__ __forceinline__ unsigned long long tab_selx(unsigned i) {
    unsigned a = (unsigned)__cvta_generic_to_shared(S_SELX) + 8u * (threadIdx.x & (SEL_COPIES - 1));
    unsigned long long v;
    asm volatile("ld.shared.u64 %0, [%1];" : "=l"(v) : "r"(a + i * (8u * SEL_COPIES)));
    return v;
}
#define TAB_SELX(i) tab_selx(i)
#else
#define TAB_SEL(i) IQ2XXS_SEL[i]
#define TAB_SELX(i) IQ2XXS_SEL[i]
#endif

// f16 → f32 is exact, so the device's one conversion instruction and the host build's integer
// form below give the same bits (the integer form took ~15 instructions a scale on the device:
// one or two a 32-value chunk in every decode). Branch-free (selects, not branches): a branch
// here ends the basic block, and ptxas then cannot issue the next chunk's loads before this
// one's arithmetic (PERF.md v5).
__device__ __forceinline__ float h2f(u16 h) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
    unsigned s = ((unsigned)h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    float sub = __uint2float_rn(m) * 5.9604644775390625e-8f;  // m · 2^-24, exact
    sub = __uint_as_float(__float_as_uint(sub) | s);
    unsigned big = s | (e == 31 ? 0x7f800000u : (e + 112) << 23) | (m << 13);
    return e == 0 ? sub : __uint_as_float(big);
}

__device__ __forceinline__ u16 ld16(const u8* p) { return *(const u16*)p; }

// IQ2_XXS as the planes hold it (dsv4_model::packed::Planes): per 32-value sub-block the grid
// word (4 grid indices) and a sign word whose bit 4i + q mod 4 + 16·⌊q / 4⌋ is the sign of value
// 4q + i (quad q = 0..7; the 8th sign of each grid entry, implicit in GGUF, stored;
// packed::iq2_sign_bit); per 128 values a head word, the 4 sub-blocks' scales (the jth's at bits
// 4j) in its low half and d (f16) in its high half.
// Quad q of a sub-block as signed int8 codes, from its selector `sel` (the grid entry's
// IQ2XXS_SEL half: a nibble a value, the level 0..2 of its magnitude 8, 25, 43) and the sign
// word: one rotation puts the quad's 4 signs at bits 2, 6, 10, 14, they are or-ed into the
// nibbles (4 + level: a negative), and one byte permute picks each byte from the magnitudes
// (bytes 0..2 of the first word) or their negatives (bytes 4..6). Three instructions a quad
// where the sign mask, xor, and and add of the magnitudes took five (PERF.md v26). q may be a
// runtime value (the tiles' lanes).
// (Inline PTX: `__byte_perm` masks its selector to 3 bits a nibble, an AND that ptxas could not
// fold into the LOP3 that merges signs and levels; these selectors never set the 4th bit.)
__device__ __forceinline__ unsigned iq2_quad(unsigned sel, unsigned sg, int q) {
    unsigned r = (unsigned)((q & 3) + 16 * (q >> 2) - 2) & 31u;
    unsigned s = __funnelshift_r(sg, sg, r);  // a rotation right by r
#ifdef __CUDA_ARCH__
    unsigned v;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(v) : "r"(0x002B1908u), "r"(0x00D5E7F8u), "r"((s & 0x4444u) | sel));
    return v;
#else
    return __byte_perm(0x002B1908u, 0x00D5E7F8u, (s & 0x4444u) | sel);
#endif
}

// Grid index kk of a sub-block's grid word a: one byte permute (a shift and a mask took two
// instructions, and the table address one more).
__device__ __forceinline__ unsigned iq2_idx(unsigned a, int kk) { return __byte_perm(a, 0u, 0x4440u | kk); }

// Grid entry kk (quads 2kk, 2kk + 1) of a sub-block as two signed int8 words (selectors: the
// entry's IQ2XXS_SEL word).
__device__ __forceinline__ uint2 iq2_quads(unsigned long long sel, unsigned sg, int kk) {
    uint2 q;
    q.x = iq2_quad((unsigned)sel, sg, 2 * kk);
    q.y = iq2_quad((unsigned)(sel >> 32), sg, 2 * kk + 1);
    return q;
}

// The head word of the 128 values holding value c (a 32-bit load: d and the 4 scales).
__device__ __forceinline__ unsigned iq2_head(const u8* __restrict__ s, int c) {
    return *(const unsigned*)(s + 4 * (c >> 7));
}

// IQ2_XXS's scale of the 32-value sub-block holding value c, from its head word hw (iq2_head):
// d · (0.5 + the sub-block's 4-bit scale) / 4 (the scale's shift is 4 · ((c >> 5) & 3)).
__device__ __forceinline__ float iq2_scale(unsigned hw, int c) {
    return __fmul_rn(__fmul_rn(h2f((u16)(hw >> 16)), 0.5f + (float)((hw >> ((c >> 3) & 12)) & 15u)), 0.25f);
}

// The bit of sign word holding value 4q + i's sign (see iq2_quad; packed::iq2_sign_bit).
__device__ __forceinline__ int iq2_sign_bit(int q, int i) { return 4 * i + (q & 3) + 16 * (q >> 2); }

// Sign word sg with an even number of negatives in each grid entry (the 8th sign of entry kk,
// value 7: quad 2kk + 1's value 3, set to the parity of the other 7), as GGUF holds it: the
// synthetic draw (`iq2_even_signs_k`) of random planes.
__device__ __forceinline__ unsigned iq2_even_signs(unsigned sg) {
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        unsigned entry = 0;  // the entry's 8 bits
#pragma unroll
        for (int i = 0; i < 4; i++) entry |= (1u << iq2_sign_bit(2 * kk, i)) | (1u << iq2_sign_bit(2 * kk + 1, i));
        unsigned last = 1u << iq2_sign_bit(2 * kk + 1, 3);
        sg ^= (unsigned)(__popc(sg & entry) & 1) * last;
    }
    return sg;
}

// Byte j of w as a float, minus `bias`, without the quarter-rate int→float conversion: the
// byte becomes the low mantissa bits of 2^23 (0x4B0000bb is 2^23 + b exactly) and the
// subtraction is exact. bias 2^23 gives the byte (0..255); 2^23 + 128 gives the int8 whose
// sign bit was flipped (w ^ 0x80808080). The same value as `(float)b`, bit for bit.
#define BIAS_U8 8388608.f
#define BIAS_S8 8388736.f
__device__ __forceinline__ float bytef(unsigned w, int j, float bias) {
    return __fsub_rn(__uint_as_float(__byte_perm(w, 0x4B000000u, 0x7540u | j)), bias);
}

// The exponent and mantissa bits placed at f32 bits 20–26 read value · 2^-120 (e = 0: the
// subnormal m/8 · 2^-126), so · 2^120 is the value exactly; the sign is or-ed in. 0x7f / 0xff: NaN.
__device__ __forceinline__ float e4m3(u8 b) {
    float v = __fmul_rn(__uint_as_float(((unsigned)b & 0x7fu) << 20), 0x1p120f);
    v = __uint_as_float(__float_as_uint(v) | (((unsigned)b & 0x80u) << 24));
    return ((unsigned)b & 0x7fu) == 0x7fu ? __uint_as_float(0x7fc00000u) : v;
}

__device__ __forceinline__ float e8m0(u8 b) {
    unsigned v = b == 0 ? 0x00400000u : (unsigned)b << 23;  // 0: 2^-127
    return __uint_as_float(b == 0xff ? 0x7fc00000u : v);
}

// Code bytes of one row of k values (GGUF: the code plane's).
__device__ __forceinline__ long long row_bytes(int f, int k) {
    switch (f) {
        case F_Q8_0: return k;
        case F_Q4_K: return k / 2;
        case F_Q2_K:
        case F_IQ2_XXS: return k / 4;
        case F_FP8: return k;
        case F_BF16: return 2LL * k;
        default: return k / 2;
    }
}

// Head bytes of one row of a GGUF format (2 a Q8_0 block; 16, 20, 8 a Q4_K, Q2_K, IQ2_XXS one).
__device__ __forceinline__ long long head_bytes(int f, int k) {
    switch (f) {
        case F_Q8_0: return (long long)(k / 32) * 2;
        case F_Q4_K: return (long long)(k / 256) * 16;
        case F_Q2_K: return (long long)(k / 256) * 20;
        case F_IQ2_XXS: return (long long)(k / 256) * 8;
        default: return 0;
    }
}

// The scales of output row o (GGUF: its heads; FP8: its 128-row block's f32 scales; FP4: its
// UE8M0 bytes).
__device__ __forceinline__ const u8* scale_row(int f, const u8* s, long long o, int k) {
    if (f == F_FP8) return (const u8*)((const float*)s + (o / 128) * ((k + 127) / 128));
    if (f == F_FP4) return s + o * (k / 32);
    return s + o * head_bytes(f, k);
}

// The raw words behind values c..c+8 of the row `w` (scales `s`, see scale_row): loads only,
// so that a loop can issue the loads of several chunks before decoding any (one memory latency
// for all of them; PERF.md v5). deq8r turns them into the values.
struct Raw8 {
    unsigned u[6];
};

template <int F>
__device__ __forceinline__ Raw8 raw8(const u8* __restrict__ w, const u8* __restrict__ s, int c) {
    Raw8 r;
    if (F == F_Q8_0) {
        r.u[0] = ld16(s + 2 * (c >> 5));
        uint2 q = *(const uint2*)(w + c);
        r.u[1] = q.x;
        r.u[2] = q.y;
    } else if (F == F_Q4_K) {
        int v = c & 255, g = v >> 6, l = v & 31;
        uint4 h = *(const uint4*)(s + 16 * (c >> 8));  // d, dmin, the 12 scale bytes
        r.u[0] = h.x;
        r.u[1] = h.y;
        r.u[2] = h.z;
        r.u[3] = h.w;
        uint2 qv = *(const uint2*)(w + 128 * (c >> 8) + 32 * g + l);
        r.u[4] = qv.x;
        r.u[5] = qv.y;
    } else if (F == F_Q2_K) {
        const u8* hd = s + 20 * (c >> 8);  // the 16 scale bytes, d, dmin
        int v = c & 255, h = v >> 7, l = v & 31;
        r.u[0] = hd[v >> 4];
        r.u[1] = *(const unsigned*)(hd + 16);
        uint2 q = *(const uint2*)(w + 64 * (c >> 8) + 32 * h + l);
        r.u[2] = q.x;
        r.u[3] = q.y;
    } else if (F == F_IQ2_XXS) {
        r.u[0] = iq2_head(s, c);
        uint2 q = *(const uint2*)(w + 8 * (c >> 5));  // the 32-value sub-block's two words
        r.u[1] = q.x;
        r.u[2] = q.y;
    } else if (F == F_FP8) {
        r.u[0] = ((const unsigned*)s)[c >> 7];
        uint2 b = *(const uint2*)(w + c);
        r.u[1] = b.x;
        r.u[2] = b.y;
    } else if (F == F_BF16) {
        uint4 b = *(const uint4*)(w + 2 * c);
        r.u[0] = b.x;
        r.u[1] = b.y;
        r.u[2] = b.z;
        r.u[3] = b.w;
    } else {
        r.u[0] = s[c >> 5];
        r.u[1] = *(const unsigned*)(w + (c >> 1));
    }
    return r;
}

// y[0..8] = values c..c+8 from their raw words.
template <int F>
__device__ __forceinline__ void deq8r(const Raw8& r, int c, float* y) {
    if (F == F_Q8_0) {
        float d = h2f((u16)r.u[0]);
        unsigned lo = r.u[1] ^ 0x80808080u, hi = r.u[2] ^ 0x80808080u;
#pragma unroll
        for (int j = 0; j < 8; j++) y[j] = __fmul_rn(bytef(j < 4 ? lo : hi, j & 3, BIAS_S8), d);
    } else if (F == F_Q4_K) {
        int v = c & 255, g = v >> 6, half = (v >> 5) & 1, j = 2 * g + half;
        // Scale byte i of the block's 12 (bytes 4..16).
        // (Selects, not an indexed array: a runtime index would put r in local memory.)
        auto sc = [&](int i) {
            unsigned wd = i < 4 ? r.u[1] : i < 8 ? r.u[2] : r.u[3];
            return (wd >> (8 * (i & 3))) & 255u;
        };
        unsigned sv, mv;
        if (j < 4) {
            sv = sc(j) & 63;
            mv = sc(j + 4) & 63;
        } else {
            sv = (sc(j + 4) & 15) | ((sc(j - 4) >> 6) << 4);
            mv = (sc(j + 4) >> 4) | ((sc(j) >> 6) << 4);
        }
        float dl = __fmul_rn(h2f((u16)r.u[0]), (float)sv), ml = __fmul_rn(h2f((u16)(r.u[0] >> 16)), (float)mv);
        unsigned lo = (r.u[4] >> (4 * half)) & 0x0F0F0F0Fu, hi = (r.u[5] >> (4 * half)) & 0x0F0F0F0Fu;
#pragma unroll
        for (int jj = 0; jj < 8; jj++) y[jj] = __fsub_rn(__fmul_rn(dl, bytef(jj < 4 ? lo : hi, jj & 3, BIAS_U8)), ml);
    } else if (F == F_Q2_K) {
        int v = c & 255, sh = 2 * ((v >> 5) & 3);
        unsigned k = r.u[0];
        float dl = __fmul_rn(h2f((u16)r.u[1]), (float)(k & 15));
        float ml = __fmul_rn(h2f((u16)(r.u[1] >> 16)), (float)(k >> 4));
        unsigned lo = (r.u[2] >> sh) & 0x03030303u, hi = (r.u[3] >> sh) & 0x03030303u;
#pragma unroll
        for (int jj = 0; jj < 8; jj++) y[jj] = __fsub_rn(__fmul_rn(dl, bytef(jj < 4 ? lo : hi, jj & 3, BIAS_U8)), ml);
    } else if (F == F_IQ2_XXS) {
        int kk = (c >> 3) & 3;
        unsigned a = r.u[1];
        float db = iq2_scale(r.u[0], c);
        // The entry's signed codes (iq2_quads) as Q8_0's: d·(−g) is −(d·g) exactly.
        uint2 q = iq2_quads(TAB_SEL(iq2_idx(a, kk)), r.u[2], kk);
        unsigned lo = q.x ^ 0x80808080u, hi = q.y ^ 0x80808080u;
#pragma unroll
        for (int j = 0; j < 8; j++) y[j] = __fmul_rn(db, bytef(j < 4 ? lo : hi, j & 3, BIAS_S8));
    } else if (F == F_FP8) {
        float sc = __uint_as_float(r.u[0]);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            y[j] = __fmul_rn(e4m3((r.u[1] >> (8 * j)) & 255), sc);
            y[4 + j] = __fmul_rn(e4m3((r.u[2] >> (8 * j)) & 255), sc);
        }
    } else if (F == F_BF16) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            y[2 * j] = __uint_as_float(r.u[j] << 16);
            y[2 * j + 1] = __uint_as_float(r.u[j] & 0xffff0000u);
        }
    } else {
        // E2M1 code j's exponent and mantissa bits placed at f32 bits 22–24 read value · 2^-126
        // (e = 0: the subnormal 0.5 · 2^-126), so · 2^126 gives the value exactly, and · sc (a
        // power of two) rounds as the table's product did; the sign is a flip. ALU work in place
        // of a constant-memory lookup a value (the expert tiles issue-bound, ncu).
        float sc = e8m0((u8)r.u[0]);
        unsigned u = r.u[1];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            unsigned mag = (j < 6 ? u << (22 - 4 * j) : u >> (4 * j - 22)) & 0x01C00000u;
            float v = __fmul_rn(__fmul_rn(__uint_as_float(mag), 0x1p126f), sc);
            y[j] = __uint_as_float(__float_as_uint(v) ^ ((u << (28 - 4 * j)) & 0x80000000u));
        }
    }
}

// y[0..8] = values c..c+8 of the row `w` (scales `s`, see scale_row).
template <int F>
__device__ __forceinline__ void deq8(const u8* __restrict__ w, const u8* __restrict__ s, int c, float* y) {
    deq8r<F>(raw8<F>(w, s, c), c, y);
}

// ---- int8 activations (the `x8` path, opt in): products on dp4a, 4 multiply-adds an
// instruction, where the f32 path spends ~14 instructions a weight (PERF.md v3). CPU twin:
// `crate::x8` (bitwise: the same integer sums, the same f32 operations, the warp's butterfly).

// An int32 (|v| < 2^22) as a float without I2F: 1.5·2^23 + v exactly, minus 1.5·2^23.
__device__ __forceinline__ float i2f_small(int v) { return __fsub_rn(__int_as_float(0x4B400000 + v), 12582912.f); }

// One 32-value chunk of a weight row (c a multiple of 32: one activation block, one Q8_0 block,
// one IQ2_XXS sub-block, two Q2_K scale groups) decoded for dp4a: q holds its 32 codes as
// signed int8, four a word; d[g] (and Q2_K's min factor m[g]) the scale of group g (Q2_K: two
// groups of 16 values, the others one of 32).
struct XChunk {
    int q[8];
    float d[2], m[2];
};

// The raw words of one 32-value chunk (loads only; see Raw8): Q8_0 its scale and 8 code words,
// Q2_K its 8 code words, d/dmin and the two scale bytes, IQ2_XXS d and the sub-block's 2 words.
struct XRaw {
    unsigned u[10];
};

__device__ __forceinline__ void ld32x8(unsigned* u, const u8* p) {  // 32 bytes, 16-byte aligned
    uint4 a = *(const uint4*)p, b = *(const uint4*)(p + 16);
    u[0] = a.x, u[1] = a.y, u[2] = a.z, u[3] = a.w, u[4] = b.x, u[5] = b.y, u[6] = b.z, u[7] = b.w;
}

template <int F>
__device__ __forceinline__ XRaw xraw32(const u8* __restrict__ w, const u8* __restrict__ s, int c) {
    XRaw r;
    if (F == F_Q8_0) {
        r.u[0] = ld16(s + 2 * (c >> 5));
        ld32x8(r.u + 1, w + c);
    } else if (F == F_Q2_K) {
        const u8* hd = s + 20 * (c >> 8);
        int v = c & 255, h = v >> 7;
        ld32x8(r.u, w + 64 * (c >> 8) + 32 * h);
        r.u[8] = *(const unsigned*)(hd + 16);
        r.u[9] = ld16(hd + (v >> 4));  // the two groups' scale bytes (v >> 4 is even)
    } else {  // F_IQ2_XXS
        r.u[0] = iq2_head(s, c);
        uint2 q = *(const uint2*)(w + 8 * (c >> 5));
        r.u[1] = q.x;
        r.u[2] = q.y;
    }
    return r;
}

// One word of each load xraw32 issued, combined (pdl_enter_after's dependency).
template <int F>
__device__ __forceinline__ unsigned xraw_dep(const XRaw& r) {
    if (F == F_Q8_0) return r.u[0] ^ r.u[1] ^ r.u[5];
    if (F == F_Q2_K) return r.u[0] ^ r.u[4] ^ r.u[8] ^ r.u[9];
    return r.u[0] ^ r.u[1];
}

// Q2_K's two scale groups of a chunk from d/dmin (one word) and the groups' scale bytes (the low
// two bytes of sc): d[g] = d · (k & 15), m[g] = dmin · (k >> 4) (xdec32 and the tiles' tdec).
__device__ __forceinline__ void q2k_scales(unsigned ddm, unsigned sc, float* d, float* m) {
    float dd = h2f((u16)ddm), dm = h2f((u16)(ddm >> 16));
#pragma unroll
    for (int g = 0; g < 2; g++) {
        unsigned k = (sc >> (8 * g)) & 255u;
        d[g] = __fmul_rn(dd, (float)(k & 15));
        m[g] = __fmul_rn(dm, (float)(k >> 4));
    }
}

template <int F>
__device__ __forceinline__ XChunk xdec32(const XRaw& r, int c) {
    XChunk ch;
    if (F == F_Q8_0) {
        ch.d[0] = h2f((u16)r.u[0]);
#pragma unroll
        for (int j = 0; j < 8; j++) ch.q[j] = (int)r.u[1 + j];
    } else if (F == F_Q2_K) {
        int sh = 2 * ((c >> 5) & 3);
#pragma unroll
        for (int j = 0; j < 8; j++) ch.q[j] = (int)((r.u[j] >> sh) & 0x03030303u);
        q2k_scales(r.u[8], r.u[9], ch.d, ch.m);
    } else {  // F_IQ2_XXS
        unsigned a = r.u[1];
        ch.d[0] = iq2_scale(r.u[0], c);
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            uint2 q = iq2_quads(TAB_SELX(iq2_idx(a, kk)), r.u[2], kk);
            ch.q[2 * kk] = (int)q.x;
            ch.q[2 * kk + 1] = (int)q.y;
        }
    }
    return ch;
}

template <int F>
__device__ __forceinline__ XChunk xdecode32(const u8* __restrict__ w, const u8* __restrict__ s, int c) {
    return xdec32<F>(xraw32<F>(w, s, c), c);
}

// acc plus the chunk's product with the activations x[0..8] (32 int8, four a word) of scale dx:
// exact integer sums, then one FMA per group (Q2_K: and one for its min term).
template <int F, bool SPLIT = false>
__device__ __forceinline__ float xapply32(const XChunk& ch, const int* x, float dx, float acc) {
    if (F == F_Q2_K) {
#pragma unroll
        for (int g = 0; g < 2; g++) {
            int is = 0, xs = 0;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                is = __dp4a(ch.q[4 * g + j], x[4 * g + j], is);
                xs = __dp4a(0x01010101, x[4 * g + j], xs);
            }
            acc = __fmaf_rn(__fmul_rn(dx, ch.d[g]), i2f_small(is), acc);
            acc = __fmaf_rn(-__fmul_rn(dx, ch.m[g]), i2f_small(xs), acc);
        }
        return acc;
    }
    // SPLIT: two chains of four dp4a, not one of eight (integer sums: the same value), for the
    // several-row groups (xrows_group), whose warps wait on dp4a's latency between decodes. With
    // it everywhere (one-row kernels too) an H100 4-layer step went batch 64 7.50 → 7.37 ms but
    // batch 1 1.018 → ~1.025 (PERF.md v40), so the one-row forms keep one chain.
    if constexpr (SPLIT) {
        int is0 = 0, is1 = 0;
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
            is0 = __dp4a(ch.q[j], x[j], is0);
            is1 = __dp4a(ch.q[j + 1], x[j + 1], is1);
        }
        return __fmaf_rn(__fmul_rn(ch.d[0], dx), i2f_small(is0 + is1), acc);
    }
    int is = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) is = __dp4a(ch.q[j], x[j], is);
    return __fmaf_rn(__fmul_rn(ch.d[0], dx), i2f_small(is), acc);
}

// c + Σ a_i·b_i over the 4 bytes, a's unsigned and b's signed (PTX dp4a.u32.s32).
__device__ __forceinline__ int dp4a_us(unsigned a, int b, int c) {
#ifdef __CUDA_ARCH__
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
#else
    for (int i = 0; i < 4; i++) c += (int)((a >> (8 * i)) & 255u) * (int)(signed char)(b >> (8 * i));
    return c;
#endif
}

// xapply32(xdec32(r, c), ...) for a chunk that meets one activation row (xrows_dot): the same
// value bit for bit. (IQ2_XXS's signed codes cost three instructions a quad since v26, so its
// one-row form, q·x = g·x − 2·(g & neg)·x with two dp4a a quad, no longer pays: the general
// form's.)
template <int F>
__device__ __forceinline__ float xapply32_one(const XRaw& r, int c, const int* x, float dx, float acc) {
    if constexpr (F == F_Q2_K) {
        // The codes where they lie (bits sh.. of each byte, masked, not shifted down: values
        // q·2^sh ≤ 192, unsigned for dp4a), then the group's sum shifted back, exactly (every
        // term is a multiple of 2^sh): one AND a word where the decode spent a shift and an AND.
        int sh = 2 * ((c >> 5) & 3);
        unsigned msk = 0x03030303u << sh;
        float dg[2], mg[2];
        q2k_scales(r.u[8], r.u[9], dg, mg);
#pragma unroll
        for (int g = 0; g < 2; g++) {
            int is = 0, xs = 0;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                is = dp4a_us(r.u[4 * g + j] & msk, x[4 * g + j], is);
                xs = __dp4a(0x01010101, x[4 * g + j], xs);
            }
            is >>= sh;
            acc = __fmaf_rn(__fmul_rn(dx, dg[g]), i2f_small(is), acc);
            acc = __fmaf_rn(-__fmul_rn(dx, mg[g]), i2f_small(xs), acc);
        }
        return acc;
    } else {
        return xapply32<F>(xdec32<F>(r, c), x, dx, acc);
    }
}

// acc plus weight values c..c+32 of row `w` (heads `s`) times the activations x (scale dx).
template <int F>
__device__ __forceinline__ float xdot32(const u8* __restrict__ w, const u8* __restrict__ s, int c, const int* x,
                                        float dx, float acc) {
    return xapply32<F>(xdecode32<F>(w, s, c), x, dx, acc);
}

// ---- end of the per-lane decode (tests/quant_host.rs builds everything above for the host)

// The block's copy of the IQ2_XXS selectors (see TAB_SEL), before any thread of it decodes: the
// first statement of every kernel that decodes (all of the block's threads reach it).
// X8: the int8 kernels' interleaved copies (TAB_SELX), two copies a 16-byte store (consecutive
// threads, consecutive slots: no bank conflict), else deq8r's one copy.
template <int F, bool X8>
__device__ __forceinline__ void fill_tabs() {
    if (F != F_IQ2_XXS) return;
    if (X8 && SEL_COPIES > 1) {
        constexpr int H = SEL_COPIES > 1 ? SEL_COPIES / 2 : 1;
        for (int i = threadIdx.x; i < 256 * H; i += blockDim.x) {
            unsigned long long v = IQ2XXS_SEL[i / H];
            ((ulonglong2*)S_SELX)[i] = make_ulonglong2(v, v);
        }
    } else if (X8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) S_SELX[i] = IQ2XXS_SEL[i];
    } else {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) S_SEL[i] = IQ2XXS_SEL[i];
    }
    __syncthreads();
}

__device__ __forceinline__ float dot8q(const float* w, const float* __restrict__ x) {
    float4 a = *(const float4*)x, b = *(const float4*)(x + 4);
    float s = w[0] * a.x;
    s += w[1] * a.y; s += w[2] * a.z; s += w[3] * a.w;
    s += w[4] * b.x; s += w[5] * b.y; s += w[6] * b.z; s += w[7] * b.w;
    return s;
}

#define Q_WARPS 8  // warps per block of every product and expert kernel (the launchers' 256 threads)

// acc[j] += w_row · x_row(j) for the nr <= R rows xrow[j] (k a multiple of 8): each lane decodes
// 8 values at c = 8·lane + 256·i straight from the row. Every output's sum runs over c in that
// order whatever R is, so a row's result does not depend on how many rows share the call (batch
// invariance) and equals the one-row result. (Staging the row through shared memory with 16-byte
// loads was measured slower: these kernels are bound by the decode's instructions, not by the
// load pattern; see PERF.md.)
// Chunks a lane loads before decoding any: 8 in the one-row kernels (4 for Q4_K's 6 raw words
// a chunk), 4 in the kernels for several rows, whose accumulators and row pointers take the
// registers (occupancy).
template <int F, bool ONE>
struct Ahead {
    static constexpr int N = (F == F_Q4_K || !ONE) ? 4 : 8;
};

template <int F, int R, int U>
__device__ __forceinline__ void qrows_dot(float* acc, const u8* __restrict__ wr, const u8* __restrict__ sr,
                                          const float* const* xrow, int nr, int k, int lane) {
    for (int c0 = lane * 8; c0 < k; c0 += 256 * U) {
        Raw8 raw[U];
#pragma unroll
        for (int u = 0; u < U; u++)
            if (c0 + 256 * u < k) raw[u] = raw8<F>(wr, sr, c0 + 256 * u);
#pragma unroll
        for (int u = 0; u < U; u++) {
            int c = c0 + 256 * u;
            if (c >= k) break;
            float wf[8];
            deq8r<F>(raw[u], c, wf);
#pragma unroll
            for (int j = 0; j < R; j++)
                if (j < nr) acc[j] += dot8q(wf, xrow[j] + c);
        }
    }
}

// The rows of one output (or expert) in groups of up to 8, each group in the smallest of the
// 8/4/2/1-row bodies that holds it (rows_all; nr ≤ R rows are live, the rest masked) — a register
// budget per group that fits its size (a lone row gets one accumulator).
// `xrow_of(r)` gives input row r, `store(r, v)` writes output row r.
template <int F, int R, int U, typename XR, typename ST>
__device__ __forceinline__ void rows_group(const u8* wr, const u8* sr, int r0, int nr, int k, int lane, XR xrow_of,
                                           ST store) {
    float acc[R];
    const float* xrow[R];
#pragma unroll
    for (int j = 0; j < R; j++) {
        acc[j] = 0.f;
        xrow[j] = xrow_of(r0 + min(j, nr - 1));
    }
    qrows_dot<F, R, U>(acc, wr, sr, xrow, nr, k, lane);
#pragma unroll
    for (int j = 0; j < R; j++) {
        float v = warp_sum(acc[j]);
        if (j < nr) store(r0 + j, v);
    }
}

// ONE: the caller has a single row (decode at batch 1): only the one-accumulator code is
// compiled in, for the registers (and occupancy) of the smallest group.
template <int F, bool ONE, typename XR, typename ST>
__device__ __forceinline__ void rows_all(const u8* wr, const u8* sr, int nrows, int k, int lane, XR xr, ST st) {
    if (ONE) {
        if (nrows > 0) rows_group<F, 1, Ahead<F, true>::N>(wr, sr, 0, 1, k, lane, xr, st);
        return;
    }
    int r0 = 0;
    while (r0 < nrows) {
        int left = nrows - r0;
        // One pass over the weights for up to 8 rows: 3 rows take the 4-row group (one row
        // masked) rather than 2 + 1, which read the row twice; 5-7 take the 8-row group.
        int nr = min(left, 8);
        if (nr >= 5) rows_group<F, 8, Ahead<F, false>::N>(wr, sr, r0, nr, k, lane, xr, st);
        else if (nr >= 3) rows_group<F, 4, Ahead<F, false>::N>(wr, sr, r0, nr, k, lane, xr, st);
        else if (nr == 2) rows_group<F, 2, Ahead<F, false>::N>(wr, sr, r0, 2, k, lane, xr, st);
        else rows_group<F, 1, Ahead<F, false>::N>(wr, sr, r0, 1, k, lane, xr, st);
        r0 += nr;
    }
}

// out[r, o] = x[r, (o / rpg)·k .. +k] · w[o, :] for r < n, o < m (as gemv_bf16). One warp per
// output.
template <int F, bool ONE>
__device__ void gemv_q(float* __restrict__ out, const float* __restrict__ x, const u8* __restrict__ w,
                       const u8* __restrict__ s, int n, int k, int m, int ldx, int rpg) {
    int wp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int o = blockIdx.x * Q_WARPS + wp;
    if (o >= m) return;
    const u8* wr = w + (long long)o * row_bytes(F, k);
    const u8* sr = scale_row(F, s, o, k);
    long long xoff = (long long)(o / rpg) * k;
    rows_all<F, ONE>(wr, sr, n, k, lane, [&](int r) { return x + (long long)r * ldx + xoff; },
                [&](int r, float v) { if (lane == 0) out[(long long)r * m + o] = v; });
}

// dot8q with the activations already loaded (a, b: x[0..4], x[4..8]): the same operations in
// the same order, so the same bits.
__device__ __forceinline__ float dot8v(const float* w, float4 a, float4 b) {
    float s = w[0] * a.x;
    s += w[1] * a.y; s += w[2] * a.z; s += w[3] * a.w;
    s += w[4] * b.x; s += w[5] * b.y; s += w[6] * b.z; s += w[7] * b.w;
    return s;
}

#define GEMVO_OUTS 4  // outputs a warp of gemvo takes (the launcher's GEMVO_OUTS)
#define GEMVO_ROWS 32  // rows a block of gemvo takes (grid.y = ⌈n / 32⌉; the launcher's)

// acc[o][j] += weight row o · x_row(j) for NW weight rows (wr[o], sr[o]) and nr ≤ 8 rows
// xrow[j]: each activation chunk is loaded once for all NW rows, where qrows_dot loads it once a
// weight row (4 bytes an FMA, which bound the several-row kernels by the L1 at hundreds of
// rows). Every sum runs over c = 8·lane + 256·i with qrows_dot's operations in its order
// (dot8v), so after the warp's butterfly each value is bitwise the several-row kernels'.
template <int F, int NW>
__device__ __forceinline__ void qrows_dot_w(float (&acc)[NW][8], const u8* const (&wr)[NW], const u8* const (&sr)[NW],
                                            const float* const (&xrow)[8], int nr, int k, int lane) {
#pragma unroll
    for (int o = 0; o < NW; o++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[o][j] = 0.f;
    for (int c = lane * 8; c < k; c += 256) {
        float wf[NW][8];
#pragma unroll
        for (int o = 0; o < NW; o++) deq8r<F>(raw8<F>(wr[o], sr[o], c), c, wf[o]);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            if (j < nr) {
                float4 a = *(const float4*)(xrow[j] + c), b = *(const float4*)(xrow[j] + c + 4);
#pragma unroll
                for (int o = 0; o < NW; o++) acc[o][j] += dot8v(wf[o], a, b);
            }
        }
    }
}

// gemv_q for many rows (exact mode's prefill and served mixed steps): a warp takes GEMVO_OUTS
// consecutive outputs of one group, a block GEMVO_ROWS rows (qrows_dot_w): bitwise gemv_q, so
// the launcher picks either by the number of rows.
template <int F>
__device__ void gemvo_q(float* __restrict__ out, const float* __restrict__ x, const u8* __restrict__ w,
                        const u8* __restrict__ s, int n, int k, int m, int ldx, int rpg) {
    constexpr int NO = GEMVO_OUTS;
    int wp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int o0 = (blockIdx.x * Q_WARPS + wp) * NO;
    if (o0 >= m) return;
    const u8* wr[NO];
    const u8* sr[NO];
#pragma unroll
    for (int o = 0; o < NO; o++) {
        wr[o] = w + (long long)(o0 + o) * row_bytes(F, k);
        sr[o] = scale_row(F, s, o0 + o, k);
    }
    // The launcher keeps a warp's outputs in one group (rpg and m multiples of NO).
    const float* xg = x + (long long)(o0 / rpg) * k;
    int r_end = min(n, (int)(blockIdx.y + 1) * GEMVO_ROWS);
    for (int r0 = blockIdx.y * GEMVO_ROWS; r0 < r_end; r0 += 8) {
        int nr = min(8, r_end - r0);
        const float* xrow[8];
#pragma unroll
        for (int j = 0; j < 8; j++) xrow[j] = xg + (long long)(r0 + min(j, nr - 1)) * ldx;
        float acc[NO][8];
        qrows_dot_w<F, NO>(acc, wr, sr, xrow, nr, k, lane);
#pragma unroll
        for (int o = 0; o < NO; o++)
#pragma unroll
            for (int j = 0; j < 8; j++) {
                float v = warp_sum(acc[o][j]);
                if (lane == 0 && j < nr) out[(long long)(r0 + j) * m + o0 + o] = v;
            }
    }
}

__device__ __forceinline__ float swiglu_q(float g, float u, float limit) {
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
    return g * sigmoid_(g) * u;
}

// Routed experts, grouped by expert (moe_sort): block x is the x-th active expert, one warp per
// output row of it; the expert's (row, slot) pairs order[off[e]..off[e+1]] run in row groups.
// ptrs holds 6·E device addresses: w1, w3, w2 blocks of every expert, then w1, w3, w2 scales.
template <int F, bool ONE>
__device__ void moe_up_q(float* __restrict__ h, const float* __restrict__ x, const unsigned* order,
                         const unsigned* off, const unsigned* active, const unsigned long long* ptrs, int nexp, int k,
                         int d, int inter, float limit) {
    if (blockIdx.x >= active[nexp]) return;
    unsigned e = active[blockIdx.x];
    int wp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int o = blockIdx.y * Q_WARPS + wp;
    if (o >= inter) return;
    long long rb = row_bytes(F, d);
    const u8* w1 = (const u8*)ptrs[e] + o * rb;
    const u8* w3 = (const u8*)ptrs[nexp + e] + o * rb;
    const u8* s1 = scale_row(F, (const u8*)ptrs[3 * nexp + e], o, d);
    const u8* s3 = scale_row(F, (const u8*)ptrs[4 * nexp + e], o, d);
    unsigned b0 = off[e];
    int cnt = (int)(off[e + 1] - b0);
    auto xr = [&](int r) { return x + (long long)(order[b0 + r] / k) * d; };
    if (ONE) {  // one token row: at most one pair per expert, both sums in registers
        if (cnt > 0) {
            float g = 0.f, u = 0.f;
            rows_group<F, 1, Ahead<F, true>::N>(w1, s1, 0, 1, d, lane, xr, [&](int, float v) { g = v; });
            rows_group<F, 1, Ahead<F, true>::N>(w3, s3, 0, 1, d, lane, xr, [&](int, float v) { u = v; });
            if (lane == 0) h[(long long)order[b0] * inter + o] = swiglu_q(g, u, limit);
        }
        return;
    }
    // The gate products of a group of up to 8 pairs first, then the up ones.
    int r0 = 0;
    while (r0 < cnt) {
        int nr = min(8, cnt - r0);
        float g[8];
        rows_all<F, ONE>(w1, s1, nr, d, lane, [&](int r) { return xr(r0 + r); }, [&](int r, float v) { g[r] = v; });
        rows_all<F, ONE>(w3, s3, nr, d, lane, [&](int r) { return xr(r0 + r); }, [&](int r, float v) {
            if (lane == 0) h[(long long)order[b0 + r0 + r] * inter + o] = swiglu_q(g[r], v, limit);
        });
        r0 += nr;
    }
}

template <int F, bool ONE>
__device__ void moe_down_q(float* __restrict__ y, const float* __restrict__ h, const unsigned* order,
                           const unsigned* off, const unsigned* active, const unsigned long long* ptrs, int nexp,
                           int d, int inter) {
    if (blockIdx.x >= active[nexp]) return;
    unsigned e = active[blockIdx.x];
    int wp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int c = blockIdx.y * Q_WARPS + wp;
    if (c >= d) return;
    const u8* w2 = (const u8*)ptrs[2 * nexp + e] + c * row_bytes(F, inter);
    const u8* s2 = scale_row(F, (const u8*)ptrs[5 * nexp + e], c, inter);
    unsigned b0 = off[e];
    int cnt = (int)(off[e + 1] - b0);
    rows_all<F, ONE>(w2, s2, cnt, inter, lane, [&](int r) { return h + (long long)order[b0 + r] * inter; },
                [&](int r, float v) { if (lane == 0) y[(long long)order[b0 + r] * d + c] = v; });
}

__device__ __forceinline__ u16 f2bf_q(float f) {
    unsigned b = __float_as_uint(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (u16)((b >> 16) | 0x40u);
    b += 0x7fffu + ((b >> 16) & 1u);
    return (u16)(b >> 16);
}

// out[o, :] = bf16(w[o, :]) for o < rows: the large-batch path hands this to cuBLAS. A
// thread's 8 values in one 16-byte store (8 two-byte stores a thread spread each warp store
// over 512 bytes: ~0.8 TB/s on an 8K-token chunk's Q8_0 projections).
template <int F>
__device__ void deq_bf16(u16* out, const u8* w, const u8* s, long long rows, int k) {
    long long chunks = rows * (k / 8);
    GRID_STRIDE(i, chunks) {
        long long o = i / (k / 8);
        int c = (int)(i % (k / 8)) * 8;
        float y[8];
        deq8<F>(w + o * row_bytes(F, k), scale_row(F, s, o, k), c, y);
        unsigned p[4];
#pragma unroll
        for (int j = 0; j < 4; j++) p[j] = (unsigned)f2bf_q(y[2 * j]) | ((unsigned)f2bf_q(y[2 * j + 1]) << 16);
        *(uint4*)(out + o * k + c) = make_uint4(p[0], p[1], p[2], p[3]);
    }
}

// Every product and expert kernel twice: `name` for any number of rows, `name1` for one.
#define ROW_KERNELS(F, N, ONE, S)                                                                                    \
    extern "C" __global__ void gemv##S##_##N(float* out, const float* x, const u8* w, const u8* s, int n, int k,    \
                                             int m, int ldx, int rpg) {                                              \
        pdl_enter();                                                                                                 \
        fill_tabs<F, false>();                                                                                       \
        gemv_q<F, ONE>(out, x, w, s, n, k, m, ldx, rpg);                                                             \
    }                                                                                                                \
    extern "C" __global__ void moe_up##S##_##N(float* h, const float* x, const unsigned* order, const unsigned* off, \
                                               const unsigned* active, const unsigned long long* ptrs, int nexp,    \
                                               int k, int d, int inter, float limit) {                               \
        pdl_enter();                                                                                                 \
        fill_tabs<F, false>();                                                                                       \
        moe_up_q<F, ONE>(h, x, order, off, active, ptrs, nexp, k, d, inter, limit);                                  \
    }                                                                                                                \
    extern "C" __global__ void moe_down##S##_##N(float* y, const float* h, const unsigned* order,                   \
                                                 const unsigned* off, const unsigned* active,                        \
                                                 const unsigned long long* ptrs, int nexp, int d, int inter) {       \
        pdl_enter();                                                                                                 \
        fill_tabs<F, false>();                                                                                       \
        moe_down_q<F, ONE>(y, h, order, off, active, ptrs, nexp, d, inter);                                          \
    }

#define QUANT_KERNELS(F, N)                                                                                          \
    ROW_KERNELS(F, N, false, )                                                                                       \
    ROW_KERNELS(F, N, true, 1)                                                                                       \
    extern "C" __global__ void gemvo_##N(float* out, const float* x, const u8* w, const u8* s, int n, int k, int m, \
                                         int ldx, int rpg) {                                                         \
        pdl_enter();                                                                                                 \
        fill_tabs<F, false>();                                                                                       \
        gemvo_q<F>(out, x, w, s, n, k, m, ldx, rpg);                                                                 \
    }                                                                                                                \
    extern "C" __global__ void deq_bf16_##N(u16* out, const u8* w, const u8* s, long long rows, int k) {            \
        pdl_enter();                                                                                                 \
        fill_tabs<F, false>();                                                                                       \
        deq_bf16<F>(out, w, s, rows, k);                                                                             \
    }

QUANT_KERNELS(F_Q8_0, q8_0)
QUANT_KERNELS(F_Q4_K, q4_k)
QUANT_KERNELS(F_Q2_K, q2_k)
QUANT_KERNELS(F_IQ2_XXS, iq2_xxs)
QUANT_KERNELS(F_FP8, fp8)
QUANT_KERNELS(F_FP4, fp4)
QUANT_KERNELS(F_BF16, bf16w)
// ---- int8-activation kernels (see xdot32)

// A row's activations in blocks of 32 (see quant_block32). One warp per block, lane i taking
// value i.
extern "C" __global__ void quant_x8(signed char* __restrict__ xq, float* __restrict__ xd, const float* __restrict__ x,
                                    long long nblocks) {
    pdl_enter();
    long long b = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (b >= nblocks) return;
    float d;
    xq[b * 32 + lane] = quant_block32(x[b * 32 + lane], &d);
    if (lane == 0) xd[b] = d;
}

// Outputs a warp computes in the one-row int8 kernels (gemv, gate/up, down); the launcher
// (cuda/quant.rs `x8_opw`, env DSV4_X8_OPW) prepends its own values and sizes the grids by them.
#ifndef X8_OPW_GEMV
#define X8_OPW_GEMV 1
#endif
#ifndef X8_OPW_UP
#define X8_OPW_UP 1
#endif
#ifndef X8_OPW_DOWN
#define X8_OPW_DOWN 1
#endif
#ifndef X8_OPWN_DOWN
#define X8_OPWN_DOWN 1
#endif
// The same for the two-launch one-row experts (moe_up1s, moe_down1s), set apart from the
// separate kernels' (moe_up1x / moe_down1x): at 4 outputs a warp those spill ~1 KB a thread
// (Q8_0 and Q2_K gate/up, 255 registers), where the two-launch pair holds (IQ2_XXS gate/up 229
// registers, every down format 128, ptxas 13.5 sm_90a). moe_up1s takes X8_OPW_UP1S for
// IQ2_XXS gate/up rows only (its Q8_0 and Q2_K forms spill at 4 too);
// cuda/quant.rs `X8Opw::up1s_for` sizes the grids the same way.
#ifndef X8_OPW_UP1S
#define X8_OPW_UP1S X8_OPW_UP
#endif
#ifndef X8_OPW_DOWN1S
#define X8_OPW_DOWN1S X8_OPW_DOWN
#endif

// acc[j] plus weight row j's chunks c0 + 1024·u (raw[j][u], u < U, those below k) times one row
// of int8 activations, chunk by chunk in that order (a batch of xrows_dot and xrows_pipe).
// X8_XAHEAD (0: off, the built-in): the activations of chunk u + 1 are loaded before chunk u is
// decoded, where they were loaded right before their own chunk's decode (ncu source counters,
// PERF.md v44: in moe_up1s each chunk's activation loads wait out their L1/L2 trip between two
// decodes). The same values; 9 more registers live.
#ifndef X8_XAHEAD
#define X8_XAHEAD 0
#endif
template <int F, int NR, int U>
__device__ __forceinline__ void xapply_batch(float* acc, const XRaw (&raw)[NR][U], int c0,
                                             const signed char* __restrict__ xq, const float* __restrict__ xd, int k) {
    if constexpr (X8_XAHEAD) {
        int4 a = make_int4(0, 0, 0, 0), b = a;
        float dx = 0.f;
        if (c0 < k) a = *(const int4*)(xq + c0), b = *(const int4*)(xq + c0 + 16), dx = xd[c0 >> 5];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int c = c0 + 1024 * u;
            if (c >= k) break;
            int x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
            float dxu = dx;
            if (u + 1 < U && c + 1024 < k)
                a = *(const int4*)(xq + c + 1024), b = *(const int4*)(xq + c + 1040), dx = xd[(c + 1024) >> 5];
#pragma unroll
            for (int j = 0; j < NR; j++) acc[j] = xapply32_one<F>(raw[j][u], c, x, dxu, acc[j]);
        }
        return;
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
        int c = c0 + 1024 * u;
        if (c >= k) break;
        int4 a = *(const int4*)(xq + c), b = *(const int4*)(xq + c + 16);
        int x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        float dx = xd[c >> 5];
#pragma unroll
        for (int j = 0; j < NR; j++) acc[j] = xapply32_one<F>(raw[j][u], c, x, dx, acc[j]);
    }
}

// out[j] = weight row j (codes wr[j], heads sr[j]) · one row of int8 activations, for NR rows,
// each sum over the row's 32-value chunks c = 32·lane + 1024·i in that order, then the warp's
// butterfly (the order of the multi-row kernels, so bitwise the same whatever NR; xq 16-byte
// aligned). Every row's loads for U chunks are issued before any chunk is
// decoded, one activation chunk serves all NR rows, and the block's IQ2_XXS grid is copied while
// the first loads are in flight: every thread of the block must call this (`live` false: no
// loads, no result; the caller returns after). EARLY: the caller has not waited for the previous
// kernel (PDL) and the weight rows are fixed (a dense product's, not a routed expert's): the
// first weight loads are issued before the wait, so they fly while the previous kernel ends.
// TABS false: the caller has filled the block's tables (fill_tabs) itself, so warps of one block
// may decode different formats (moe_down1s).
template <int F, int NR, int U, bool EARLY = false, bool TABS = true>
__device__ __forceinline__ void xrows_dot(float* out, const u8* const* wr, const u8* const* sr,
                                          const signed char* __restrict__ xq, const float* __restrict__ xd, int k,
                                          int lane, bool live) {
    float acc[NR];
    XRaw raw[NR][U];
#pragma unroll
    for (int j = 0; j < NR; j++) acc[j] = 0.f;
    auto load = [&](int c0) {
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int j = 0; j < NR; j++)
                if (live && c0 + 1024 * u < k) raw[j][u] = xraw32<F>(wr[j], sr[j], c0 + 1024 * u);
    };
    auto apply = [&](int c0) { xapply_batch<F, NR, U>(acc, raw, c0, xq, xd, k); };
    int c0 = lane * 32;
    load(c0);
    if (EARLY) {
        unsigned dep = 0;
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int j = 0; j < NR; j++)
                if (live && c0 + 1024 * u < k) dep ^= xraw_dep<F>(raw[j][u]);
        pdl_enter_after(dep);
    }
    if (TABS) fill_tabs<F, true>();
    if (!live) return;
    apply(c0);
    for (c0 += 1024 * U; c0 < k; c0 += 1024 * U) {
        load(c0);
        apply(c0);
    }
#pragma unroll
    for (int j = 0; j < NR; j++) out[j] = warp_sum(acc[j]);
}

// Chunks a lane loads a batch in the pipelined form (X8_PIPE, the launcher's DSV4_X8_PIPE; 0:
// xrows_dot's form) in the expert kernels: IQ2_XXS's 3 words a chunk take X8_PIPE; the 9–10
// words of Q8_0 and Q2_K one chunk a batch (with two chunks their two buffers took 20–40
// registers more than xrows_dot's one). Offline sm_90a, 4 and 8 outputs a warp: moe_up1s 80
// registers at X8_PIPE = 2 (as without), 96 at 4 (2 blocks an SM instead of 3); moe_down1s
// 60 → 64.
#ifndef X8_PIPE
#define X8_PIPE 0
#endif
#ifndef X8_PIPE_GEMV  // the same for the dense one-row products (gemv_x8's general form)
#define X8_PIPE_GEMV 0
#endif
template <int F>
__device__ constexpr int pipe_u() {
    return F == F_IQ2_XXS ? X8_PIPE : 1;
}

// xrows_dot's sums for a warp with P outputs of G weight rows each (rows(p, g, w, s): output p's
// row g), in the same order (an output's chunks c = 32·lane + 1024·i, then the butterfly), so
// bitwise the same, but software-pipelined: the next batch of U chunks (the output's next, or
// the next output's first) is loaded before the current one is decoded, so a warp always has
// weight bytes in flight while it computes. xrows_dot loads a warp's batch, waits, decodes and
// (one batch an output in the one-row expert kernels) exits: an SM's warps then waited and
// computed in turn (ncu on moe_up1s: DRAM 31 %, issue IPC 1.5 of ~4, 35 % occupancy; PERF.md
// v25). store(p, v) gets output p's G sums on every lane. Every thread of the block calls it
// (`live` false: no loads, no stores); TABS as xrows_dot's.
template <int F, int G, int U, bool TABS, bool EARLY = false, typename RowF, typename StoreF>
__device__ __forceinline__ void xrows_pipe(int P, RowF rows, StoreF store, const signed char* __restrict__ xq,
                                           const float* __restrict__ xd, int k, int lane, bool live) {
    const int step = 1024 * U, nb = (k + step - 1) / step, T = P * nb;
    XRaw ra[G][U], rb[G][U];
    float acc[G];
    int lp = 0, lb = 0;  // the next batch to load: output lp's batch lb
    // Chunk c0 + 1024·u read as chunk c0 of planes advanced by u·1024 values (the same words:
    // 1024 values are whole blocks of every int8 format), so a batch's loads share one address
    // computation and take immediate offsets.
    auto load = [&](XRaw(&r)[G][U]) {
        int c0 = lane * 32 + step * lb;
#pragma unroll
        for (int g = 0; g < G; g++) {
            const u8 *w, *s;
            rows(lp, g, w, s);
#pragma unroll
            for (int u = 0; u < U; u++)
                if (c0 + 1024 * u < k)
                    r[g][u] = xraw32<F>(w + u * row_bytes(F, 1024), s + u * head_bytes(F, 1024), c0);
        }
        if (++lb == nb) lb = 0, lp++;
    };
    int ap = 0, ab = 0;  // the batch to decode: output ap's batch ab
    auto apply = [&](const XRaw(&r)[G][U]) {
        int c0 = lane * 32 + step * ab;
        if (ab == 0)
#pragma unroll
            for (int g = 0; g < G; g++) acc[g] = 0.f;
        xapply_batch<F, G, U>(acc, r, c0, xq, xd, k);
        if (++ab == nb) {
            float v[G];
#pragma unroll
            for (int g = 0; g < G; g++) v[g] = warp_sum(acc[g]);
            store(ap, v);
            ab = 0, ap++;
        }
    };
    if (live) load(ra);
    // xrows_dot's EARLY: the first batch's loads fly while the previous kernel ends (only output
    // 0's here, where xrows_dot issued every output's first batch).
    if (EARLY) {
        unsigned dep = 0;
#pragma unroll
        for (int g = 0; g < G; g++)
#pragma unroll
            for (int u = 0; u < U; u++)
                if (live && lane * 32 + 1024 * u < k) dep ^= xraw_dep<F>(ra[g][u]);
        pdl_enter_after(dep);
    }
    if (TABS) fill_tabs<F, true>();
    if (!live) return;
    for (int t = 0; t < T; t += 2) {  // two buffers, each decoded while the other fills
        if (t + 1 < T) load(rb);
        apply(ra);
        if (t + 1 >= T) break;
        if (t + 2 < T) load(ra);
        apply(rb);
    }
}

// Whether this block, of the 32 / OB blocks that form a 32-value group g (OB < 32 outputs each),
// is the last to count itself in cnt[g] (zero between launches; the last sets it back to zero),
// with the pattern of the attention kernel's slice merge: one thread fences for the block after
// the barrier the caller passed. Every thread of the block calls it.
template <int OB>
__device__ __forceinline__ bool last_of_group(unsigned* cnt, int g) {
    __shared__ unsigned last;
    if (threadIdx.x == 0) {
        __threadfence();
        unsigned prev = atomicAdd(&cnt[g], 1u);
        last = prev == 32 / OB - 1;
        if (last) {
            cnt[g] = 0;  // every block of the group has counted: ready for the next launch
            __threadfence();
        }
    }
    __syncthreads();
    return last;
}

// After the block wrote its OB outputs o0.. of the row `row` (width values): the int8 codes and
// scale of each 32-value group it completes (quant_block32 over the group, as quant_x8 forms
// them). A block of fewer than 32 outputs counts itself in cnt[group] (zero between launches);
// the group's last block quantises it, with the pattern of the attention kernel's slice merge
// (one thread fences for the block after the barrier). Every thread of the block calls it.
template <int OB>
__device__ __forceinline__ void quant_groups(const float* row, signed char* qrow, float* drow, unsigned* cnt, int o0,
                                             int width) {
    // Other block widths (DSV4_X8_OPW of 3, 5, 6, 7) would straddle groups: the launchers do not
    // take these kernels then, and this compiles to nothing so the module still builds.
    if constexpr (!(OB % 32 == 0 || 32 % OB == 0)) return;
    int lane = threadIdx.x & 31, wp = threadIdx.x >> 5;
    __syncthreads();  // every warp's outputs stored
    int g;
    if (OB >= 32) {
        g = o0 / 32 + wp;  // warp w quantises the block's group w
        if (wp >= OB / 32 || 32 * g >= width) return;
    } else {
        g = o0 / 32;
        if (!last_of_group<OB>(cnt, g) || wp != 0) return;
    }
    float dd;
    signed char q = quant_block32(__ldcg(row + 32 * g + lane), &dd);
    qrow[32 * g + lane] = q;
    if (lane == 0) drow[g] = dd;
}

// quant_groups for a block that wrote outputs o0..o0 + OB of each of n rows (row r's values at
// out + r·width, its codes at oq + r·width and scales at od + r·width / 32, as quant_x8 forms
// the n rows): one counter a group counts the block once for all its rows, and the group's
// last block quantises the group in every row (warp w: the tasks w, w + 8, .. of the n·⌈OB / 32⌉
// (row, group) pairs). Every thread of the block calls it.
template <int OB>
__device__ __forceinline__ void quant_groups_rows(const float* out, signed char* oq, float* od, unsigned* cnt,
                                                  int o0, int width, int n) {
    if constexpr (!(OB % 32 == 0 || 32 % OB == 0)) return;
    constexpr int GB = OB >= 32 ? OB / 32 : 1;  // groups a block completes (or shares)
    int lane = threadIdx.x & 31, wp = threadIdx.x >> 5;
    __syncthreads();  // every warp's outputs stored
    if (OB < 32 && !last_of_group<OB>(cnt, o0 / 32)) return;
    for (int t = wp; t < n * GB; t += Q_WARPS) {
        int r = t / GB, g = o0 / 32 + t % GB;
        if (32 * g >= width) continue;
        long long base = (long long)r * width;
        float dd;
        signed char q = quant_block32(__ldcg(out + base + 32 * g + lane), &dd);
        oq[base + 32 * g + lane] = q;
        if (lane == 0) od[base / 32 + g] = dd;
    }
}

// out[0, o] = x[(o / rpg)·k .. +k] · w[o, :] for one row, from its int8 activations (xq, xd
// as quant_x8 wrote them over the whole row of width ldx); X8_OPW_GEMV outputs a warp (the
// launcher keeps rpg a multiple of it, so a warp's outputs share their activations). Waits for
// the previous kernel inside xrows_dot, after its first weight loads.
// bx: the block's index within this product (blockIdx.x, or relative to its entry of an X8Group).
// TWIN: the output's int8 codes and scales too (oq, od; cnt: zeroed counters of its 32-value
// groups), for a product whose output feeds another int8 product (wo_a's, read by wo_b).
// P outputs a warp and U chunks a lane loaded ahead (the sums do not depend on either): the
// launcher's default, or 4 and 1 for k ≤ 1024 (gemv1x4: one chunk a lane per row).
template <int F, bool TWIN = false, int P = X8_OPW_GEMV, int U = 4>
__device__ void gemv_x8(float* __restrict__ out, const signed char* __restrict__ xq, const float* __restrict__ xd,
                        const u8* __restrict__ w, const u8* __restrict__ s, int k, int m, int rpg, int bx,
                        signed char* oq = nullptr, float* od = nullptr, unsigned* cnt = nullptr) {
    int wp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int o = (bx * Q_WARPS + wp) * P;
    bool live = o < m;
    long long xoff = live ? (long long)(o / rpg) * k : 0;
    if constexpr (X8_PIPE_GEMV > 0 && U == 4) {  // the general form (not gemv1x4's one chunk a row)
        long long rb = row_bytes(F, k);
        auto rows = [&](int p, int, const u8*& rw, const u8*& rs) {
            int oj = min(o + p, m - 1);  // outputs past m: the last row again, not stored
            rw = w + oj * rb;
            rs = scale_row(F, s, oj, k);
        };
        auto store = [&](int p, const float* v) {
            if (lane == 0 && o + p < m) out[o + p] = v[0];
        };
        // IQ2_XXS rows X8_PIPE_GEMV chunks a batch, the wider formats half as many (one output's
        // two buffers: gemv1x_q8_0 keeps its 62 registers at X8_PIPE_GEMV = 4).
        constexpr int PU = F == F_IQ2_XXS ? X8_PIPE_GEMV : (X8_PIPE_GEMV + 1) / 2;
        xrows_pipe<F, 1, PU, true, true>(P, rows, store, xq + xoff, xd + xoff / 32, k, lane, live);
        if (TWIN) quant_groups<Q_WARPS * P>(out, oq, od, cnt, bx * Q_WARPS * P, m);
        return;
    }
    const u8* wr[P];
    const u8* sr[P];
#pragma unroll
    for (int j = 0; j < P; j++) {  // outputs past m: the last row again, not stored
        int oj = min(o + j, m - 1);
        wr[j] = w + (long long)oj * row_bytes(F, k);
        sr[j] = scale_row(F, s, oj, k);
    }
    float v[P];
    xrows_dot<F, P, U, true>(v, wr, sr, xq + xoff, xd + xoff / 32, k, lane, live);
    if (live)
#pragma unroll
        for (int j = 0; j < P; j++)
            if (lane == 0 && o + j < m) out[o + j] = v[j];
    if (TWIN) quant_groups<Q_WARPS * P>(out, oq, od, cnt, bx * Q_WARPS * P, m);
}

// The one-row products of one input with up to XG_MAX weights of one int8 format and the same
// k, in one launch (gemv1xg): entry e (codes w[e], heads s[e], output out[e] of m[e] values)
// takes blocks b0[e]..b0[e + 1] of the grid, each the sums gemv1x forms. The attention input's
// wq_a and wkv (1,024 and 512 outputs) and q's wq_b and the indexer's wq_b each ran a launch
// and its latency chain alone.
#define XG_MAX 4
struct X8Group {
    const u8* w[XG_MAX];
    const u8* s[XG_MAX];
    float* out[XG_MAX];
    int m[XG_MAX];
    int b0[XG_MAX + 1];
    int count;
};

// The entry holding block bx, and bx made relative to the entry's first block.
__device__ __forceinline__ int x8g_entry(const X8Group& g, int* bx) {
    int e = 0;
#pragma unroll
    for (int i = 1; i < XG_MAX; i++)
        if (i < g.count && *bx >= g.b0[i]) e = i;
    *bx -= g.b0[e];
    return e;
}

// Bytes [p, p + n) into L2, a 128-byte line a lane.
__device__ __forceinline__ void pf_span(const u8* p, long long n, int lane) {
    unsigned long long a = ((unsigned long long)p & ~127ull) + 128ull * lane, end = (unsigned long long)p + n;
    for (; a < end; a += 32 * 128) asm volatile("prefetch.L2 [%0];" ::"l"(a));
}

// X8_PF1_BLOCKS: the one-row expert kernels' form of X8_PF_BLOCKS (moe_up1s / moe_down1s and
// the one-row pairs): each warp asks L2 for the rows of the warp X8_PF1_BLOCKS blocks later in
// launch order (up: the same pair, a later output; down: a later output of the same pair), so
// that block's loads find them in L2. 0: off (the built-in; `dsv4 bench --synthetic kernels
// --tables experts` times it against DRAM and L2).
#ifndef X8_PF1_BLOCKS
#define X8_PF1_BLOCKS 0
#endif

// Gate/up rows o..o+P−1 (P: X8_OPW_UP, X8_OPW_UP1S in moe_up1s) of expert e (address table
// ptrs of nexp experts) on one row of int8 activations, SwiGLU'd into hrow[o..]: the one-row
// pair of moe_up_x8 and moe_up1s. Every thread of the block calls it (`live` false: no loads, no
// store). U: chunks a lane loads ahead (xrows_dot's; the sums do not depend on it).
template <int F, int U = 4, int P = X8_OPW_UP>
__device__ __forceinline__ void up1_pair(float* __restrict__ hrow, const signed char* __restrict__ xq,
                                         const float* __restrict__ xd, const unsigned long long* ptrs, int nexp,
                                         unsigned e, int o, int d, int inter, float limit, bool live) {
    int lane = threadIdx.x & 31;
    long long rb = row_bytes(F, d);
    if constexpr (X8_PIPE > 0) {
        const u8 *w1 = (const u8*)ptrs[e], *w3 = (const u8*)ptrs[nexp + e];
        const u8 *s1 = (const u8*)ptrs[3 * nexp + e], *s3 = (const u8*)ptrs[4 * nexp + e];
        auto rows = [&](int p, int g, const u8*& w, const u8*& s) {
            int oj = min(o + p, inter - 1);  // outputs past inter: the last row again, not stored
            w = (g == 0 ? w1 : w3) + oj * rb;
            s = scale_row(F, g == 0 ? s1 : s3, oj, d);
        };
        auto store = [&](int p, const float* v) {
            if (lane == 0 && o + p < inter) hrow[o + p] = swiglu_q(v[0], v[1], limit);
        };
        xrows_pipe<F, 2, pipe_u<F>(), true>(P, rows, store, xq, xd, d, lane, live);
        return;
    }
    const u8* wr[2 * P];
    const u8* sr[2 * P];
#pragma unroll
    for (int j = 0; j < P; j++) {  // outputs past inter: the last row again, not stored
        int oj = min(o + j, inter - 1);
        wr[2 * j] = (const u8*)ptrs[e] + oj * rb;
        sr[2 * j] = scale_row(F, (const u8*)ptrs[3 * nexp + e], oj, d);
        wr[2 * j + 1] = (const u8*)ptrs[nexp + e] + oj * rb;
        sr[2 * j + 1] = scale_row(F, (const u8*)ptrs[4 * nexp + e], oj, d);
    }
    if constexpr (X8_PF1_BLOCKS > 0) {
        int of = o + (int)((X8_PF1_BLOCKS + gridDim.x - 1) / gridDim.x) * Q_WARPS * P;
        if (live && of < inter) {
            long long hb = head_bytes(F, d);
            pf_span((const u8*)ptrs[e] + of * rb, P * rb, lane);
            pf_span((const u8*)ptrs[nexp + e] + of * rb, P * rb, lane);
            pf_span(scale_row(F, (const u8*)ptrs[3 * nexp + e], of, d), P * hb, lane);
            pf_span(scale_row(F, (const u8*)ptrs[4 * nexp + e], of, d), P * hb, lane);
        }
    }
    float v[2 * P];
    xrows_dot<F, 2 * P, U>(v, wr, sr, xq, xd, d, lane, live);
    if (!live) return;
#pragma unroll
    for (int j = 0; j < P; j++)
        if (lane == 0 && o + j < inter) hrow[o + j] = swiglu_q(v[2 * j], v[2 * j + 1], limit);
}

// The one-row routed experts on int8 activations (see moe_up_q): each active expert has one
// pair; X8_OPW_UP outputs a warp, each a gate and an up row.
template <int F>
__device__ void moe_up_x8(float* __restrict__ h, const signed char* __restrict__ xq, const float* __restrict__ xd,
                          const unsigned* order, const unsigned* off, const unsigned* active,
                          const unsigned long long* ptrs, int nexp, int d, int inter, float limit) {
    if (blockIdx.x >= active[nexp]) return;  // uniform in the block
    unsigned e = active[blockIdx.x];
    int wp = threadIdx.x >> 5;
    int o = (blockIdx.y * Q_WARPS + wp) * X8_OPW_UP;
    unsigned b0 = off[e];
    bool live = o < inter && off[e + 1] != b0;
    long long r = live ? order[b0] : 0;
    up1_pair<F>(h + r * inter, xq, xd, ptrs, nexp, e, o, d, inter, limit, live);
}

// Expert e's down-projection rows c..c+P (codes wr, heads sr) in the address table `ptrs`;
// outputs past d take the last row again (the callers do not store them).
template <int F, int P>
__device__ __forceinline__ void down_rows(const u8** wr, const u8** sr, const unsigned long long* ptrs, int nexp,
                                          unsigned e, int c, int d, int inter) {
#pragma unroll
    for (int j = 0; j < P; j++) {
        int cj = min(c + j, d - 1);
        wr[j] = (const u8*)ptrs[2 * nexp + e] + cj * row_bytes(F, inter);
        sr[j] = scale_row(F, (const u8*)ptrs[5 * nexp + e], cj, inter);
    }
}

// v[j] = expert e's down row c + j · one pair's int8 activations (hq, hd: its row of `inter`),
// for j < P (X8_OPW_DOWN, or X8_OPW_DOWN1S in moe_down1s): the one-row pair of moe_down_x8 and
// moe_down1s. TABS as xrows_dot's.
template <int F, bool TABS = true, int P = X8_OPW_DOWN>
__device__ __forceinline__ void down1_pair(float* v, const signed char* __restrict__ hq, const float* __restrict__ hd,
                                           const unsigned long long* ptrs, int nexp, unsigned e, int c, int d,
                                           int inter, bool live) {
    if constexpr (X8_PIPE > 0) {
        const u8 *w2 = (const u8*)ptrs[2 * nexp + e], *s2 = (const u8*)ptrs[5 * nexp + e];
        long long rb = row_bytes(F, inter);
        auto rows = [&](int p, int, const u8*& w, const u8*& s) {
            int cj = min(c + p, d - 1);  // down_rows' rows
            w = w2 + cj * rb;
            s = scale_row(F, s2, cj, inter);
        };
        auto store = [&](int p, const float* r) {  // v[p], selected so v stays in registers
#pragma unroll
            for (int j = 0; j < P; j++)
                if (j == p) v[j] = r[0];
        };
        xrows_pipe<F, 1, pipe_u<F>(), TABS>(P, rows, store, hq, hd, inter, threadIdx.x & 31, live);
        return;
    }
    const u8* wr[P];
    const u8* sr[P];
    down_rows<F, P>(wr, sr, ptrs, nexp, e, c, d, inter);
    if constexpr (X8_PF1_BLOCKS > 0) {
        int cf = c + X8_PF1_BLOCKS * P;  // blocks along x, P outputs each (moe_down1s)
        if (live && cf < d) {
            int n = min(P, d - cf);
            long long rb = row_bytes(F, inter);
            pf_span((const u8*)ptrs[2 * nexp + e] + cf * rb, n * rb, threadIdx.x & 31);
            pf_span(scale_row(F, (const u8*)ptrs[5 * nexp + e], cf, inter), n * head_bytes(F, inter), threadIdx.x & 31);
        }
    }
    xrows_dot<F, P, 2, false, TABS>(v, wr, sr, hq, hd, inter, threadIdx.x & 31, live);
}

// hq/hd: quant_x8 of the up kernel's output rows (one per pair, `inter` wide); X8_OPW_DOWN
// outputs a warp.
template <int F>
__device__ void moe_down_x8(float* __restrict__ y, const signed char* __restrict__ hq, const float* __restrict__ hd,
                            const unsigned* order, const unsigned* off, const unsigned* active,
                            const unsigned long long* ptrs, int nexp, int d, int inter) {
    constexpr int P = X8_OPW_DOWN;
    if (blockIdx.x >= active[nexp]) return;  // uniform in the block
    unsigned e = active[blockIdx.x];
    int wp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int c = (blockIdx.y * Q_WARPS + wp) * P;
    unsigned b0 = off[e];
    bool live = c < d && off[e + 1] != b0;
    long long r = live ? order[b0] : 0;
    float v[P];
    down1_pair<F>(v, hq + r * inter, hd + r * inter / 32, ptrs, nexp, e, c, d, inter, live);
    if (!live) return;
#pragma unroll
    for (int j = 0; j < P; j++)
        if (lane == 0 && c + j < d) y[r * d + c + j] = v[j];
}

// X8_PTAB (0: off, the built-in): the two-launch expert kernels (moe_up1s, moe_down1s) copy the
// columns of the experts' address table they use into shared memory while the slot's expert id
// loads, so a block's first weight loads wait for one L2 trip (the id and the table at once)
// instead of two in turn (the id, then the expert's table entries: the chain PERF.md v44 read in
// the SASS). The same pointers, so the same values. Tables of more than PTAB_MAX experts (none
// in V4: 256) keep the two trips.
#ifndef X8_PTAB
#define X8_PTAB 0
#endif
#define PTAB_MAX 256

// Set bits of v below bit c: the shared table's slot of column c when only the columns in v are
// kept.
__host__ __device__ constexpr int bits_below(unsigned v, int c) {
    return c == 0 ? 0 : (int)((v >> (c - 1)) & 1u) + bits_below(v, c - 1);
}

// An expert's six table entries (the columns of `ptrs`, nexp experts) as a one-expert table `loc`
// (loc[c] = ptrs[c·nexp + e]) for the columns in COLS, through the block's shared copy `tab`
// (popcount(COLS)·PTAB_MAX entries, column c at slot bits_below(COLS, c)) where X8_PTAB is on and
// the table fits. The pairs then take (loc, 1, 0) for (ptrs, nexp, e). Every thread of the block
// calls it with the same nexp (it holds a barrier).
template <unsigned COLS>
__device__ __forceinline__ void expert_ptrs(unsigned long long (&loc)[6], unsigned long long* tab,
                                            const unsigned long long* ptrs, int nexp, unsigned e, bool use) {
#pragma unroll
    for (int c = 0; c < 6; c++) loc[c] = 0;
    if (X8_PTAB && nexp <= PTAB_MAX) {
        for (int i = threadIdx.x; i < nexp; i += blockDim.x)
#pragma unroll
            for (int c = 0; c < 6; c++)
                if (COLS >> c & 1) tab[bits_below(COLS, c) * PTAB_MAX + i] = ptrs[c * nexp + i];
        __syncthreads();
        if (use)
#pragma unroll
            for (int c = 0; c < 6; c++)
                if (COLS >> c & 1) loc[c] = tab[bits_below(COLS, c) * PTAB_MAX + e];
        return;
    }
    if (use)
#pragma unroll
        for (int c = 0; c < 6; c++)
            if (COLS >> c & 1) loc[c] = ptrs[c * nexp + e];
}

// X8_STAGE (3: both, the built-in since v52; 0: off): the two-launch experts' rows go through
// shared memory (moe_up1s: the routed IQ2_XXS gate/up rows; moe_down1s: every pair's down
// rows). A warp copies its rows' bytes of a chunk round (values 1024·i.. of every row: whole
// blocks of each format) by cp.async into stages of its own and decodes a round from there,
// while later rounds land. The register forms hold
// every round of all their rows before decoding: moe_up1s 229 registers at 4 outputs a warp, one
// block an SM, so 8 warps whose issue slots sat mostly idle (~37 µs a layer from L2 for ~13 µs
// of DRAM bytes); moe_down1s 128, two blocks. Here a warp holds one chunk's words at a time. The
// chunks, their order and the butterfly are xrows_dot's, so the sums are the same bits.
// H100, 32 q2 layers (PERF.md v52): moe_up1s 33.9 → 30.1 µs, moe_down1s 18.7 → 14.5 (ncu), the
// batch-1 step 5.59 → 5.36 ms; and the n-row forms then beat the row-group kernels for a
// verify's 2–4 rows (cuda/bf16.rs `ffn1_rows_env`, which reads a zero here as off). Bits: 1
// moe_up1s, 2 moe_down1s. moe_up1s stages at up to 4 outputs a warp (at 8 its stages would pass
// the 48 KB of static shared memory).
#ifndef X8_STAGE
#define X8_STAGE 3
#endif
#define X8_STAGE_UP (X8_STAGE & 1)
#define X8_STAGE_DOWN (X8_STAGE & 2)

__device__ __forceinline__ void cp16(unsigned sa, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Code and head bytes of one row's chunk round (1024 values) in the staged formats.
template <int F>
__host__ __device__ constexpr int stage_cb() {
    return F == F_Q8_0 ? 1024 : 256;
}
template <int F>
__host__ __device__ constexpr int stage_hb() {
    return F == F_Q8_0 ? 64 : F == F_Q2_K ? 80 : 32;
}
template <int F>
__host__ __device__ constexpr int stage_row() {
    return stage_cb<F>() + stage_hb<F>();
}
template <int F>
__host__ __device__ constexpr bool stageable() {
    return F == F_Q8_0 || F == F_Q2_K || F == F_IQ2_XXS;
}

// Round i of NR rows into stage sa (NR·CB code bytes, then NR·HB head bytes), 16 bytes a copy
// over the warp's lanes; rows(r, w, s) gives row r's code and head pointers (formed per copy:
// a table of row pointers indexed by a lane-dependent row went to local memory).
template <int F, int NR, typename RowF>
__device__ __forceinline__ void stage_round(unsigned sa, RowF rows, int i, int lane) {
    constexpr int CB = stage_cb<F>(), HB = stage_hb<F>(), CS = CB / 16, HS = HB / 16;
#pragma unroll
    for (int m = 0; m < (NR * CS + 31) / 32; m++) {
        int q = lane + 32 * m, r = q / CS, g = q % CS;
        const u8 *w, *sc;
        rows(r, w, sc);
        if (q < NR * CS) cp16(sa + CB * r + 16 * g, w + CB * i + 16 * g);
    }
#pragma unroll
    for (int m = 0; m < (NR * HS + 31) / 32; m++) {
        int q = lane + 32 * m, r = q / HS, g = q % HS;
        const u8 *w, *sc;
        rows(r, w, sc);
        if (q < NR * HS) cp16(sa + NR * CB + HB * r + 16 * g, sc + HB * i + 16 * g);
    }
}

// Row r's chunk of this lane (values 32·lane.. of the round) from a stage of NR rows.
template <int F, int NR>
__device__ __forceinline__ XRaw stage_raw(const u8* st, int r, int lane) {
    return xraw32<F>(st + stage_cb<F>() * r, st + NR * stage_cb<F>() + stage_hb<F>() * r, 32 * lane);
}

// up1_pair's outputs for IQ2_XXS rows through the warp's two stages `st` (2 × 2P·288 bytes): a
// ring, each round's copies issued two rounds ahead. d a multiple of 1024, every row 16-byte
// aligned (the caller checks).
template <int P>
__device__ __forceinline__ void up1_staged(float* __restrict__ hrow, const signed char* __restrict__ xq,
                                           const float* __restrict__ xd, const unsigned long long* loc, int o,
                                           int d, int inter, float limit, bool live, u8* st) {
    constexpr int F = F_IQ2_XXS, NR = 2 * P, SB = NR * stage_row<F>();
    int lane = threadIdx.x & 31, nround = d >> 10;
    // Row 2j + g: output o + j's gate (w1, s1) or up row (w3, s3); past inter the last row again.
    auto rows = [&](int r, const u8*& w, const u8*& sc) {
        long long oj = min(o + (r >> 1), inter - 1);
        w = (const u8*)(r & 1 ? loc[1] : loc[0]) + oj * (d / 4);
        sc = (const u8*)(r & 1 ? loc[4] : loc[3]) + oj * (d / 32);
    };
    unsigned sa = (unsigned)__cvta_generic_to_shared(st);
    if (live) {
        stage_round<F, NR>(sa, rows, 0, lane);
        cp_commit();
        if (nround > 1) stage_round<F, NR>(sa + SB, rows, 1, lane);
        cp_commit();
    }
    fill_tabs<F, true>();
    if (!live) return;
    float acc[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) acc[r] = 0.f;
    for (int i = 0; i < nround; i++) {
        int c = 32 * lane + 1024 * i;
        int4 a = *(const int4*)(xq + c), b = *(const int4*)(xq + c + 16);
        int x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        float dx = xd[c >> 5];
        cp_wait<1>();
        __syncwarp();
        const u8* sb = st + (i & 1) * SB;
#pragma unroll
        for (int r = 0; r < NR; r++) acc[r] = xapply32_one<F>(stage_raw<F, NR>(sb, r, lane), c, x, dx, acc[r]);
        __syncwarp();  // every lane has read the stage before it is refilled
        if (i + 2 < nround) stage_round<F, NR>(sa + (i & 1) * SB, rows, i + 2, lane);
        cp_commit();
    }
#pragma unroll
    for (int j = 0; j < P; j++) {
        float g = warp_sum(acc[2 * j]), u = warp_sum(acc[2 * j + 1]);
        if (lane == 0 && o + j < inter) hrow[o + j] = swiglu_q(g, u, limit);
    }
}

// down1_pair's v[j] (expert e's down rows c + j, address table loc of one expert) through the
// warp's stages `st` (every round of the P rows at once: at most 2 rounds, inter ≤ 2048), each
// round decoded as soon as it lands. Every row 16-byte aligned (the caller checks); the block's
// tables filled by the caller.
template <int F, int P>
__device__ __forceinline__ void down1_staged(float* v, const signed char* __restrict__ hq, const float* __restrict__ hd,
                                             const unsigned long long* loc, int c, int d, int inter, bool live,
                                             u8* st) {
    constexpr int SB = P * stage_row<F>();
    int lane = threadIdx.x & 31, nround = inter >> 10;
    auto rows = [&](int r, const u8*& w, const u8*& sc) {
        long long cj = min(c + r, d - 1);
        w = (const u8*)loc[2] + cj * row_bytes(F, inter);
        sc = scale_row(F, (const u8*)loc[5], cj, inter);
    };
    unsigned sa = (unsigned)__cvta_generic_to_shared(st);
    float acc[P];
#pragma unroll
    for (int j = 0; j < P; j++) acc[j] = 0.f;
    if (live) {
        stage_round<F, P>(sa, rows, 0, lane);
        cp_commit();
        if (nround > 1) stage_round<F, P>(sa + SB, rows, 1, lane);
        cp_commit();
#pragma unroll
        for (int i = 0; i < 2; i++) {
            if (i >= nround) break;
            int cc = 32 * lane + 1024 * i;
            int4 a = *(const int4*)(hq + cc), b = *(const int4*)(hq + cc + 16);
            int x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
            float dx = hd[cc >> 5];
            if (i == 0) cp_wait<1>();
            else cp_wait<0>();
            __syncwarp();
#pragma unroll
            for (int j = 0; j < P; j++) acc[j] = xapply32_one<F>(stage_raw<F, P>(st + i * SB, j, lane), cc, x, dx, acc[j]);
        }
    }
#pragma unroll
    for (int j = 0; j < P; j++) v[j] = warp_sum(acc[j]);
}

// down1_pair's v[0..P] one output at a time (the same sums): X8_STAGE's fallback, whose
// registers then do not set the kernel's.
template <int F, int P>
__device__ __forceinline__ void down1_each(float* v, const signed char* __restrict__ hq, const float* __restrict__ hd,
                                           const unsigned long long* loc, int c, int d, int inter) {
#pragma unroll
    for (int p = 0; p < P; p++) {
        float t[1];
        down1_pair<F, false, 1>(t, hq, hd, loc, 1, 0, c + p, d, inter, c + p < d);
        v[p] = t[0];
    }
}

// ---- A few token rows' routed experts and shared expert in two launches (moe_up1s,
// moe_down1s): the one-row kernels' pairs above, with neither moe_sort, quant_x8 of h,
// moe_combine nor the add of the two outputs. Token row t has k + 1 pairs: pair j < k is slot j
// of its route (expert ids[t·k + j]), pair k the shared expert (its own table sptrs, format S).
// Each pair is a one-row product of its own (an expert two rows chose is read twice), so every
// row's results are bitwise those of the separate launches, and of the row alone.

// Grid (n·(k + 1), ⌈inter / (8·P)⌉), P X8_OPW_UP1S for IQ2_XXS rows, else X8_OPW_UP: block
// (t·(k + 1) + j, y) forms row t's pair j's outputs y·8·P..; xq / xd hold n rows of d; h, hq, hd
// n·(k + 1) rows of `inter` (hd: inter / 32 scales a row), cnt n·(k + 1)·inter / 32 counters
// (unused where 8·P is a multiple of 32: a block then owns whole groups). ROWS false: one row
// (n = 1), the form a decode step runs. Registers (ptxas 13.5, sm_90a): IQ2_XXS/Q8_0 229 at
// P = 4 (1 block an SM; ROWS 234), 80 at P = 1 (3 blocks; ROWS 94).
// X8_UP1_SHARED (1, the built-in): blocks the shared pair's outputs of a y-block are split over,
// where the routed rows are staged IQ2_XXS at up to 4 outputs a warp (the launcher's grid has
// k + X8_UP1_SHARED pair columns a row: cuda/bf16.rs `up1_shared_split`). The shared pair's Q8_0
// rows take one output at a time in registers, 4 × 8.7 KB a warp in turn; at 2 its warps take
// 2 outputs, and the one-row grid is 6 × 64 + 2 × 64 = 512 blocks, one wave of 132 SMs at
// X8_UP1_BLOCKS 4 (PERF.md v53). Each output's sums are the same; a split block writes half of
// a 32-value group, whose codes the group's last block forms (quant_groups' ticket).
#ifndef X8_UP1_SHARED
#define X8_UP1_SHARED 1
#endif
template <int R, int P>
__host__ __device__ constexpr int up1_split() {
    return R == F_IQ2_XXS && X8_STAGE_UP && P <= 4 && P % X8_UP1_SHARED == 0 ? X8_UP1_SHARED : 1;
}

template <int R, int S, bool ROWS>
__device__ void moe_up1s(float* __restrict__ h, signed char* __restrict__ hq, float* __restrict__ hd, unsigned* cnt,
                         const signed char* __restrict__ xq, const float* __restrict__ xd, const unsigned* ids,
                         const unsigned long long* ptrs, const unsigned long long* sptrs, int nexp, int k, int d,
                         int inter, float limit) {
    constexpr int P = R == F_IQ2_XXS ? X8_OPW_UP1S : X8_OPW_UP;  // up1s_opw
    constexpr int SPLIT = up1_split<R, P>(), PS = P / SPLIT;
    int cols = k + SPLIT;  // pair columns a row: the routed slots, then the shared pair's SPLIT
    int t = ROWS ? blockIdx.x / cols : 0, j = ROWS ? blockIdx.x % cols : blockIdx.x, wp = threadIdx.x >> 5;
    if (SPLIT > 1 && j >= k) {
        // The shared pair's part j − k of the y-block's outputs, PS a warp.
        int o0 = blockIdx.y * Q_WARPS * P + (j - k) * Q_WARPS * PS, o = o0 + wp * PS;
        long long row = (long long)(t * (k + 1) + k) * inter;
        if (ROWS) {
            xq += (long long)t * d;
            xd += (long long)t * d / 32;
        }
#pragma unroll 1
        for (int p = 0; p < PS; p++)
            up1_pair<S, 2, 1>(h + row, xq, xd, sptrs, 1, 0, o + p, d, inter, limit, o + p < inter);
        quant_groups<Q_WARPS * PS>(h + row, hq + row, hd + row / 32, cnt + row / 32, o0, inter);
        return;
    }
    int o0 = blockIdx.y * Q_WARPS * P, o = o0 + wp * P;
    bool live = o < inter;
    long long row = (long long)(t * (k + 1) + j) * inter;
    if (ROWS) {
        xq += (long long)t * d;
        xd += (long long)t * d / 32;
    }
    if (j < k) {
        __shared__ unsigned long long tab[X8_PTAB ? 4 * PTAB_MAX : 1];
        unsigned long long loc[6];
        expert_ptrs<0x1bu>(loc, tab, ptrs, nexp, ids[t * k + j], true);  // w1, w3, s1, s3
        if constexpr (X8_STAGE_UP && R == F_IQ2_XXS && P <= 4) {
            __shared__ __align__(16) u8 st[Q_WARPS][2 * 2 * P * stage_row<F_IQ2_XXS>()];
            // Uniform in the block: every row 16-byte aligned (d / 4 and d / 32 bytes apart).
            if ((d & 1023) == 0 && ((loc[0] | loc[1] | loc[3] | loc[4]) & 15) == 0) {
                up1_staged<P>(h + row, xq, xd, loc, o, d, inter, limit, live, st[wp]);
            } else {  // one output at a time, as the shared rows below
#pragma unroll 1
                for (int p = 0; p < P; p++)
                    up1_pair<R, 2, 1>(h + row, xq, xd, loc, 1, 0, o + p, d, inter, limit, live && o + p < inter);
            }
        } else {
            up1_pair<R, 4, P>(h + row, xq, xd, loc, 1, 0, o, d, inter, limit, live);
        }
    }
    // Q8_0's 9 words a chunk: 2 chunks ahead, so its registers do not set the routed blocks'
    // occupancy (the separate kernels: 79 registers for IQ2_XXS, 111 for Q8_0 with 4 ahead).
    // With X8_STAGE_UP the shared rows take one output at a time (a quarter of the registers; each
    // output's sums as before).
    else if constexpr (X8_STAGE_UP && R == F_IQ2_XXS && P <= 4) {
#pragma unroll 1
        for (int p = 0; p < P; p++)
            up1_pair<S, 2, 1>(h + row, xq, xd, sptrs, 1, 0, o + p, d, inter, limit, live && o + p < inter);
    } else up1_pair<S, S == F_Q8_0 && R != F_Q8_0 ? 2 : 4, P>(h + row, xq, xd, sptrs, 1, 0, o, d, inter, limit, live);
    quant_groups<Q_WARPS * P>(h + row, hq + row, hd + row / 32, cnt + row / 32, o0, inter);
}

// Grid (⌈d / X8_OPW_DOWN1S⌉, n), k + 1 ≤ Q_WARPS: warp j of block (x, t) forms row t's pair j's
// down outputs c = x·X8_OPW_DOWN1S..; then routed[t, c] = Σ_j wts[t·k + j]·y_j (moe_combine's
// order and roundings), shared[t, c] = the shared expert's y, out[t, c] = routed + shared (the
// add kernel's). ROWS false: one row (n = 1; the row offsets cost 7 % more instructions).
template <int R, int S, bool ROWS>
__device__ void moe_down1s(float* __restrict__ routed, float* __restrict__ shared, float* __restrict__ out,
                           const signed char* __restrict__ hq, const float* __restrict__ hd, const unsigned* ids,
                           const float* wts, const unsigned long long* ptrs, const unsigned long long* sptrs, int nexp,
                           int k, int d, int inter) {
    constexpr int P = X8_OPW_DOWN1S;
    __shared__ float ys[Q_WARPS][P];
    int wp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int c = blockIdx.x * P, t = ROWS ? blockIdx.y : 0;
    // Both formats' tables before the warps part ways (the barriers are the block's).
    fill_tabs<R, true>();
    if (S != R) fill_tabs<S, true>();
    float v[P];
    long long row = ((long long)t * (k + 1) + wp) * inter;
    if (ROWS) {
        ids += t * k;
        wts += t * k;
        routed += (long long)t * d;
        shared += (long long)t * d;
        out += (long long)t * d;
    }
    // A routed warp's slot weight, loaded beside its weights and applied by the warp itself
    // (ys holds w_j·y_j): the block's closing combine then waits on no global load (it took
    // one L2 trip after the barrier in every block). The same products, the same sum order.
    float wv = wp < k && lane == 0 ? wts[wp] : 0.f;
    // The shared expert's two entries are loaded before the routed warps' table (and its barrier).
    unsigned long long sloc[6] = {0, 0, wp == k ? sptrs[2] : 0, 0, 0, wp == k ? sptrs[5] : 0};
    __shared__ unsigned long long tab[X8_PTAB ? 2 * PTAB_MAX : 1];
    unsigned long long loc[6];
    expert_ptrs<0x24u>(loc, tab, ptrs, nexp, wp < k ? ids[wp] : 0u, wp < k);  // w2, s2
    // Warp j's stages at j·RB (the shared warp's, at k·RB, SB bytes): every round at once, where
    // that fits beside the tables in the 48 KB of static shared memory (not Q8_0 routed rows).
    // SH: passes the shared warp takes its P rows in (2 where all of them would not fit: 8 Q2_K
    // outputs a warp with Q8_0 shared rows, whose 512 blocks are one wave at 4 an SM; PERF.md
    // v53), each P / SH rows' rounds at once; the same sums.
    constexpr int RB = 2 * P * stage_row<R>(), SB = 2 * P * stage_row<S>();
    constexpr int SH = (Q_WARPS - 1) * RB + SB <= 40 * 1024 || P % 2 ? 1 : 2, SBH = SB / SH;
    if constexpr (X8_STAGE_DOWN && stageable<R>() && stageable<S>() &&
                  (Q_WARPS - 1) * RB + SBH <= (SH == 1 ? 40 : 46) * 1024) {
        __shared__ __align__(16) u8 st[(Q_WARPS - 1) * RB + SBH];
        // Per warp (no barrier follows): whole rounds, 16-byte aligned rows. (Selected values,
        // not a pointer to either table: that put both tables in local memory.)
        unsigned long long al = wp < k ? loc[2] | loc[5] : sloc[2] | sloc[5];
        bool staged = (inter & 1023) == 0 && inter <= 2048 && (al & 15) == 0;
        if (wp < k) {
            if (staged) down1_staged<R, P>(v, hq + row, hd + row / 32, loc, c, d, inter, c < d, st + wp * RB);
            else down1_each<R, P>(v, hq + row, hd + row / 32, loc, c, d, inter);
        } else if (wp == k) {
            if (staged) {
#pragma unroll
                for (int hp = 0; hp < SH; hp++) {
                    int ch = c + hp * (P / SH);
                    down1_staged<S, P / SH>(v + hp * (P / SH), hq + row, hd + row / 32, sloc, ch, d, inter, ch < d,
                                            st + wp * RB);
                }
            } else down1_each<S, P>(v, hq + row, hd + row / 32, sloc, c, d, inter);
        }
    } else if constexpr (X8_STAGE_DOWN) {  // DOWN1_BOUNDS's registers: one output at a time
        if (wp < k) down1_each<R, P>(v, hq + row, hd + row / 32, loc, c, d, inter);
        else if (wp == k) down1_each<S, P>(v, hq + row, hd + row / 32, sloc, c, d, inter);
    } else if (wp < k) down1_pair<R, false, P>(v, hq + row, hd + row / 32, loc, 1, 0, c, d, inter, c < d);
    else if (wp == k) down1_pair<S, false, P>(v, hq + row, hd + row / 32, sloc, 1, 0, c, d, inter, c < d);
    if (wp <= k && lane == 0 && c < d)
#pragma unroll
        for (int p = 0; p < P; p++) ys[wp][p] = wp < k ? __fmul_rn(wv, v[p]) : v[p];
    __syncthreads();
    int p = threadIdx.x;
    if (p >= P || c + p >= d) return;
    float acc = 0.f;
    for (int i = 0; i < k; i++) acc = __fadd_rn(acc, ys[i][p]);
    float s = ys[k][p];
    routed[c + p] = acc;
    shared[c + p] = s;
    out[c + p] = __fadd_rn(acc, s);
}

// Several rows on int8 activations: each chunk's weight codes decoded once, then per row its
// dp4a sums and FMAs, the same operations as one row alone (integer sums are exact), so a row's
// result does not depend on how many rows share the call. Row groups as rows_all. NW weight
// rows (wr[w], sr[w]: the up kernel's gate and up rows) share each activation load, and all
// their loads for U chunks are issued before any decode; store(r, v) gets row r's results of
// the NW weight rows (v[w]) together, so a caller pairing them (gate and up) keeps no values
// across rows (a runtime-indexed array there went to local memory: PERF.md v40).
// Row r's activations are xq[e..e + k] with scales xd[e / 32..], e = xr_of(r): a row keeps a
// 32-bit offset, not two 64-bit pointers (3 registers a row fewer: 24 in the 8-row group).
template <int F, int R, int NW, int U, typename XR, typename ST>
__device__ __forceinline__ void xrows_group(const u8* const* wr, const u8* const* sr, const signed char* __restrict__ xq,
                                            const float* __restrict__ xd, int r0, int nr, int k, int lane, XR xr_of,
                                            ST store) {
    float acc[NW][R];
    unsigned xe[R];
#pragma unroll
    for (int j = 0; j < R; j++) {
#pragma unroll
        for (int w = 0; w < NW; w++) acc[w][j] = 0.f;
        xe[j] = xr_of(r0 + min(j, nr - 1));
    }
    for (int c0 = lane * 32; c0 < k; c0 += 1024 * U) {
        XRaw raw[NW][U];
        // A chunk past k loads the row's last chunk again and is never applied: every raw word
        // is written each iteration, where a skipped load kept the last iteration's word live
        // across the loop (ptxas spilled two head words of the one-row group for it).
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int w = 0; w < NW; w++) raw[w][u] = xraw32<F>(wr[w], sr[w], min(c0 + 1024 * u, k - 32));
#pragma unroll
        for (int u = 0; u < U; u++) {
            int c = c0 + 1024 * u;
            if (c >= k) break;
            if constexpr (R == 1) {
                // One row (an expert holding one pair, the common case at batch 16): the
                // one-row form, the same value (xapply32_one).
                unsigned e = xe[0] + c;
                int4 a = *(const int4*)(xq + e), b = *(const int4*)(xq + e + 16);
                int x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
                float dx = xd[e >> 5];
#pragma unroll
                for (int w = 0; w < NW; w++) acc[w][0] = xapply32_one<F>(raw[w][u], c, x, dx, acc[w][0]);
            } else {
                XChunk ch[NW];
#pragma unroll
                for (int w = 0; w < NW; w++) ch[w] = xdec32<F>(raw[w][u], c);
#pragma unroll
                for (int j = 0; j < R; j++) {
                    if (j < nr) {
                        unsigned e = xe[j] + c;
                        int4 a = *(const int4*)(xq + e), b = *(const int4*)(xq + e + 16);
                        int x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
                        float dx = xd[e >> 5];
#pragma unroll
                        for (int w = 0; w < NW; w++) acc[w][j] = xapply32<F, true>(ch[w], x, dx, acc[w][j]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < R; j++) {
        float v[NW];
#pragma unroll
        for (int w = 0; w < NW; w++) v[w] = warp_sum(acc[w][j]);
        if (j < nr) store(r0 + j, (const float*)v);
    }
}

// All nrows rows in groups of up to 8 (one pass over the weights a group; see rows_all; two
// weight rows: groups of up to 4, for registers); more chunks in flight for small groups
// (registers: a group also holds its rows' accumulators; four-row groups 2 chunks ahead since
// v40, at 64 registers with no spills: H100 4 q2 layers, batch 64 7.37 → 7.26 ms). GM caps the
// group size the kernel instantiates (the launcher's bound on nrows: 2 or 4), so a call of few
// rows does not carry the 8-row group's registers; any cap gives the same values (a row's sums
// never depend on its group).
template <int F, int NW, int GM = 8, typename XR, typename ST>
__device__ __forceinline__ void xrows_all(const u8* const* wr, const u8* const* sr, const signed char* __restrict__ xq,
                                          const float* __restrict__ xd, int nrows, int k, int lane, XR xr, ST st) {
    constexpr int U1 = NW == 1 ? 2 : 4, G = (NW == 1 ? 8 : 4) < GM ? (NW == 1 ? 8 : 4) : GM;
    int r0 = 0;
    while (r0 < nrows) {
        int left = nrows - r0;
        int nr = min(left, G);
        if (G >= 5 && nr >= 5) xrows_group<F, 8, NW, 1>(wr, sr, xq, xd, r0, nr, k, lane, xr, st);
        else if (G >= 3 && nr >= 3) xrows_group<F, 4, NW, 2>(wr, sr, xq, xd, r0, nr, k, lane, xr, st);
        else if (nr == 2) xrows_group<F, 2, NW, 2>(wr, sr, xq, xd, r0, 2, k, lane, xr, st);
        else xrows_group<F, 1, NW, U1>(wr, sr, xq, xd, r0, 1, k, lane, xr, st);
        r0 += nr;
    }
}

// L2 prefetch for the several-row expert kernels: each warp asks for the rows that the same
// warp of a block X8_PF_BLOCKS later in launch order (x fastest: the same expert, a later output
// group) will read, so that block's weight loads hit L2 instead of DRAM. Their warps wait mostly
// on those loads (ncu at batch 64: ~2/3 of moe_downx's long-scoreboard samples; one DRAM trip a
// warp, whose loop body runs once, PERF.md v41). A prefetch holds no register and waits for
// nothing. 0: off (the A/B sets it; values never change).
#ifndef X8_PF_BLOCKS
#define X8_PF_BLOCKS 0
#endif
// X8_PF_SELF: each warp of the several-row dense products (gemvx) asks for its own row (codes
// and heads) before its first load, so its eight-row groups' later passes over the row (4 at
// k = 4,096 for Q8_0) find it in L2. 0: off. (In the expert kernels the same prefetch raised
// their spills, 96 → 120 bytes and 0 → 48 offline; not there.)
#ifndef X8_PF_SELF
#define X8_PF_SELF 0
#endif
// Outputs between a block's and the block X8_PF_BLOCKS later's (per_block outputs a block).
__device__ __forceinline__ int pf_ahead(int per_block) {
    return (int)((X8_PF_BLOCKS + gridDim.x - 1) / gridDim.x) * per_block;
}

// X8_PF_SELF's prefetch of a warp's weight row of k values.
template <int F>
__device__ __forceinline__ void pf_self(const u8* wr, const u8* sr, int k, int lane) {
    if constexpr (X8_PF_SELF) {
        pf_span(wr, row_bytes(F, k), lane);
        pf_span(sr, head_bytes(F, k), lane);
    }
}

// out[r, o] for n rows (see gemv_q); xq/xd: quant_x8 of x [n, ldx] (ldx a multiple of 32); GM:
// xrows_all's cap. OPW outputs a warp (1 or 2; 2: m and rpg even): a warp's two weight rows
// share each activation load and have their loads in flight together (xrows_group's NW), the
// same sums an output.
// bx: the block's index within this product (blockIdx.x, or relative to its X8Group entry).
// TWIN: the output's int8 codes and scales too (oq, od; cnt: zeroed counters of its 32-value
// groups; quant_groups_rows), as gemv_x8's for one row.
template <int F, int GM = 8, int OPW = 1, bool TWIN = false>
__device__ void gemvn_x8(float* __restrict__ out, const signed char* __restrict__ xq, const float* __restrict__ xd,
                         const u8* __restrict__ w, const u8* __restrict__ s, int n, int k, int m, int ldx, int rpg,
                         int bx, signed char* oq = nullptr, float* od = nullptr, unsigned* cnt = nullptr) {
    if constexpr (TWIN) {
        // Every warp reaches the block's barriers: a warp past m forms nothing.
        if ((bx * Q_WARPS + (int)(threadIdx.x >> 5)) * OPW < m) gemvn_x8<F, GM, OPW>(out, xq, xd, w, s, n, k, m, ldx, rpg, bx);
        quant_groups_rows<Q_WARPS * OPW>(out, oq, od, cnt, bx * Q_WARPS * OPW, m, n);
        return;
    }
    int wp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int o = (bx * Q_WARPS + wp) * OPW;
    if (o >= m) return;
    long long xoff = (long long)(o / rpg) * k;
    const u8* wr[OPW];
    const u8* sr[OPW];
#pragma unroll
    for (int i = 0; i < OPW; i++) {
        wr[i] = w + (long long)(o + i) * row_bytes(F, k);
        sr[i] = scale_row(F, s, o + i, k);
        pf_self<F>(wr[i], sr[i], k, lane);
    }
    xrows_all<F, OPW, GM>(wr, sr, xq, xd, n, k, lane, [&](int r) { return (unsigned)(r * ldx + xoff); },
                          [&](int r, const float* v) {
                              if (lane == 0)
#pragma unroll
                                  for (int i = 0; i < OPW; i++) out[(long long)r * m + o + i] = v[i];
                          });
}

// Routed experts of several token rows on int8 activations (see moe_up_q): an expert's pairs in
// groups of up to 8, each group's gate and up products in one pass (their loads in flight
// together). A warp one output. (v27's rounds, a warp striding over several outputs to pay the
// block's chain once, gained 1.6 % at batch 16 where 23 % was predicted, and their loop raised
// this kernel's spills from 60 to 380 bytes and moe_downx_q2_k's from 12 to 224 at the
// 80-register bound: removed, PERF.md v28.)
template <int F>
__device__ void moe_upn_x8(float* __restrict__ h, const signed char* __restrict__ xq, const float* __restrict__ xd,
                           const unsigned* order, const unsigned* off, const unsigned* active,
                           const unsigned long long* ptrs, int nexp, int k, int d, int inter, float limit) {
    uint4 sl = moe_slots(active, nexp)[blockIdx.x];  // one trip for the expert and its pairs
    if (blockIdx.x >= sl.w) return;
    unsigned e = sl.x, b0 = sl.y;
    int cnt = (int)sl.z;
    int wp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int o0 = blockIdx.y * Q_WARPS + wp, o = min(o0, inter - 1);
    long long rb = row_bytes(F, d);
    const u8* wr[2] = {(const u8*)ptrs[e] + o * rb, (const u8*)ptrs[nexp + e] + o * rb};
    const u8* sr[2] = {scale_row(F, (const u8*)ptrs[3 * nexp + e], o, d),
                       scale_row(F, (const u8*)ptrs[4 * nexp + e], o, d)};
    if constexpr (X8_PF_BLOCKS > 0) {
        int of = o0 + pf_ahead(Q_WARPS);
        if (of < inter)
#pragma unroll
            for (int w = 0; w < 2; w++) {
                pf_span((const u8*)ptrs[w * nexp + e] + of * rb, rb, lane);
                pf_span(scale_row(F, (const u8*)ptrs[(3 + w) * nexp + e], of, d), head_bytes(F, d), lane);
            }
    }
    // The table after the expert's pointers and pairs are asked for: its L2 trip runs beside
    // theirs instead of before them (the block's chain to its first weight load one trip shorter).
    fill_tabs<F, true>();
    if (o0 >= inter) return;
    xrows_all<F, 2>(wr, sr, xq, xd, cnt, d, lane, [&](int r) { return order[b0 + r] / k * (unsigned)d; },
                    [&](int r, const float* v) {
                        if (lane == 0) h[(long long)order[b0 + r] * inter + o] = swiglu_q(v[0], v[1], limit);
                    });
}

// X8_OPWN_DOWN (1 or 2) outputs a warp, sharing each activation load (the same sums). GM:
// xrows_all's cap (an expert holds at most as many pairs as the call has rows).
template <int F, int GM = 8>
__device__ void moe_downn_x8(float* __restrict__ y, const signed char* __restrict__ hq, const float* __restrict__ hd,
                             const unsigned* order, const unsigned* off, const unsigned* active,
                             const unsigned long long* ptrs, int nexp, int d, int inter) {
    constexpr int P = X8_OPWN_DOWN;
    uint4 sl = moe_slots(active, nexp)[blockIdx.x];  // one trip for the expert and its pairs
    if (blockIdx.x >= sl.w) return;
    unsigned e = sl.x, b0 = sl.y;
    int cnt = (int)sl.z;
    int wp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int c = (blockIdx.y * Q_WARPS + wp) * P;
    if (c >= d) return;
    const u8* wr[P];
    const u8* sr[P];
    down_rows<F, P>(wr, sr, ptrs, nexp, e, c, d, inter);
    if constexpr (X8_PF_BLOCKS > 0) {
        int cf = c + pf_ahead(Q_WARPS * P);
        if (cf < d) {
            int n = min(P, d - cf);
            long long rb = row_bytes(F, inter);
            pf_span((const u8*)ptrs[2 * nexp + e] + cf * rb, n * rb, lane);
            pf_span(scale_row(F, (const u8*)ptrs[5 * nexp + e], cf, inter), n * head_bytes(F, inter), lane);
        }
    }
    xrows_all<F, P, GM>(wr, sr, hq, hd, cnt, inter, lane, [&](int r) { return order[b0 + r] * (unsigned)inter; },
                    [&](int r, const float* v) {
                        if (lane == 0)
#pragma unroll
                            for (int w = 0; w < P; w++)
                                if (c + w < d) y[(long long)order[b0 + r] * d + c + w] = v[w];
                    });
}

#define X8_KERNELS(F, N, UPB, DNB, DNB2)                                                                                           \
    extern "C" __global__ void gemv1x_##N(float* out, const signed char* xq, const float* xd, const u8* w,          \
                                          const u8* s, int n, int k, int m, int ldx, int rpg) {                      \
        gemv_x8<F>(out, xq, xd, w, s, k, m, rpg, blockIdx.x); /* waits for the previous kernel inside */             \
    }                                                                                                                \
    extern "C" __global__ void gemv1xq_##N(float* out, signed char* oq, float* od, unsigned* cnt,                   \
                                           const signed char* xq, const float* xd, const u8* w, const u8* s, int k,  \
                                           int m, int rpg) {                                                         \
        gemv_x8<F, true>(out, xq, xd, w, s, k, m, rpg, blockIdx.x, oq, od, cnt);                                     \
    }                                                                                                                \
    extern "C" __global__ void gemv1xg_##N(X8Group g, const signed char* xq, const float* xd, int k) {               \
        int bx = blockIdx.x, e = x8g_entry(g, &bx);                                                                  \
        gemv_x8<F>(g.out[e], xq, xd, g.w[e], g.s[e], k, g.m[e], g.m[e], bx);                                         \
    }                                                                                                                \
    extern "C" __global__ void gemv1x4_##N(float* out, const signed char* xq, const float* xd, const u8* w,         \
                                           const u8* s, int n, int k, int m, int ldx, int rpg) {                     \
        gemv_x8<F, false, 4, 1>(out, xq, xd, w, s, k, m, rpg, blockIdx.x);                                           \
    }                                                                                                                \
    extern "C" __global__ void gemv1xg4_##N(X8Group g, const signed char* xq, const float* xd, int k) {              \
        int bx = blockIdx.x, e = x8g_entry(g, &bx);                                                                  \
        gemv_x8<F, false, 4, 1>(g.out[e], xq, xd, g.w[e], g.s[e], k, g.m[e], g.m[e], bx);                            \
    }                                                                                                                \
    extern "C" __global__ void moe_up1x_##N(float* h, const signed char* xq, const float* xd, const unsigned* order, \
                                            const unsigned* off, const unsigned* active,                            \
                                            const unsigned long long* ptrs, int nexp, int k, int d, int inter,       \
                                            float limit) {                                                           \
        pdl_enter();                                                                                                 \
        moe_up_x8<F>(h, xq, xd, order, off, active, ptrs, nexp, d, inter, limit);                                    \
    }                                                                                                                \
    extern "C" __global__ void moe_down1x_##N(float* y, const signed char* hq, const float* hd,                     \
                                              const unsigned* order, const unsigned* off, const unsigned* active,    \
                                              const unsigned long long* ptrs, int nexp, int d, int inter) {          \
        pdl_enter();                                                                                                 \
        moe_down_x8<F>(y, hq, hd, order, off, active, ptrs, nexp, d, inter);                                         \
    }                                                                                                                \
    extern "C" __global__ void gemvx_##N(float* out, const signed char* xq, const float* xd, const u8* w,           \
                                         const u8* s, int n, int k, int m, int ldx, int rpg) {                       \
        pdl_enter();                                                                                                 \
        fill_tabs<F, true>();                                                                                        \
        gemvn_x8<F>(out, xq, xd, w, s, n, k, m, ldx, rpg, blockIdx.x);                                               \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(256, 4) gemvx2_##N(float* out, const signed char* xq, const float* xd, const u8* w, \
                                          const u8* s, int n, int k, int m, int ldx, int rpg) {                      \
        pdl_enter();                                                                                                 \
        fill_tabs<F, true>();                                                                                        \
        gemvn_x8<F, 2>(out, xq, xd, w, s, n, k, m, ldx, rpg, blockIdx.x);                                            \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(256, 3) gemvx4_##N(float* out, const signed char* xq, const float* xd, const u8* w, \
                                          const u8* s, int n, int k, int m, int ldx, int rpg) {                      \
        pdl_enter();                                                                                                 \
        fill_tabs<F, true>();                                                                                        \
        gemvn_x8<F, 4>(out, xq, xd, w, s, n, k, m, ldx, rpg, blockIdx.x);                                            \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(256, 4) gemvx2p_##N(float* out, const signed char* xq, const float* xd, const u8* w, \
                                          const u8* s, int n, int k, int m, int ldx, int rpg) {                      \
        pdl_enter();                                                                                                 \
        fill_tabs<F, true>();                                                                                        \
        gemvn_x8<F, 2, 2>(out, xq, xd, w, s, n, k, m, ldx, rpg, blockIdx.x);                                         \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(256, 3) gemvx4p_##N(float* out, const signed char* xq, const float* xd, const u8* w, \
                                          const u8* s, int n, int k, int m, int ldx, int rpg) {                      \
        pdl_enter();                                                                                                 \
        fill_tabs<F, true>();                                                                                        \
        gemvn_x8<F, 4, 2>(out, xq, xd, w, s, n, k, m, ldx, rpg, blockIdx.x);                                         \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(256, 4) gemvx2pq_##N(float* out, signed char* oq, float* od,        \
                                          unsigned* cnt, const signed char* xq, const float* xd, const u8* w,        \
                                          const u8* s, int n, int k, int m, int ldx, int rpg) {                      \
        pdl_enter();                                                                                                 \
        fill_tabs<F, true>();                                                                                        \
        gemvn_x8<F, 2, 2, true>(out, xq, xd, w, s, n, k, m, ldx, rpg, blockIdx.x, oq, od, cnt);                      \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(256, 3) gemvx4pq_##N(float* out, signed char* oq, float* od,        \
                                          unsigned* cnt, const signed char* xq, const float* xd, const u8* w,        \
                                          const u8* s, int n, int k, int m, int ldx, int rpg) {                      \
        pdl_enter();                                                                                                 \
        fill_tabs<F, true>();                                                                                        \
        gemvn_x8<F, 4, 2, true>(out, xq, xd, w, s, n, k, m, ldx, rpg, blockIdx.x, oq, od, cnt);                      \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(256, 3) gemvxg4p_##N(X8Group g, const signed char* xq, const float* xd, \
                                          int n, int k) {                                                            \
        pdl_enter();                                                                                                 \
        fill_tabs<F, true>();                                                                                        \
        int bx = blockIdx.x, e = x8g_entry(g, &bx);                                                                  \
        gemvn_x8<F, 4, 2>(g.out[e], xq, xd, g.w[e], g.s[e], n, k, g.m[e], k, g.m[e], bx);                            \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(256, UPB) moe_upx_##N(float* h, const signed char* xq, const float* xd, const unsigned* order, \
                                           const unsigned* off, const unsigned* active,                             \
                                           const unsigned long long* ptrs, int nexp, int k, int d, int inter,        \
                                           float limit) {                                                            \
        pdl_enter();                                                                                                 \
        moe_upn_x8<F>(h, xq, xd, order, off, active, ptrs, nexp, k, d, inter, limit);                                \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(256, DNB) moe_downx_##N(float* y, const signed char* hq, const float* hd, \
                                             const unsigned* order, const unsigned* off, const unsigned* active,     \
                                             const unsigned long long* ptrs, int nexp, int d, int inter) {           \
        pdl_enter();                                                                                                 \
        fill_tabs<F, true>();                                                                                        \
        moe_downn_x8<F>(y, hq, hd, order, off, active, ptrs, nexp, d, inter);                                        \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(256, DNB2) moe_downx2_##N(float* y, const signed char* hq, const float* hd, \
                                             const unsigned* order, const unsigned* off, const unsigned* active,     \
                                             const unsigned long long* ptrs, int nexp, int d, int inter) {           \
        pdl_enter();                                                                                                 \
        fill_tabs<F, true>();                                                                                        \
        moe_downn_x8<F, 2>(y, hq, hd, order, off, active, ptrs, nexp, d, inter);                                     \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(256, DNB) moe_downx4_##N(float* y, const signed char* hq, const float* hd, \
                                             const unsigned* order, const unsigned* off, const unsigned* active,     \
                                             const unsigned long long* ptrs, int nexp, int d, int inter) {           \
        pdl_enter();                                                                                                 \
        fill_tabs<F, true>();                                                                                        \
        moe_downn_x8<F, 4>(y, hq, hd, order, off, active, ptrs, nexp, d, inter);                                     \
    }

// UPB / DNB: blocks an SM the several-row up / down kernels are compiled for. At batch 16 an
// expert holds one or two rows and these kernels are bound by issue with 2 blocks an SM (ncu:
// 16 warps an SM, 1.1 eligible a scheduler); H200, 4 q2 layers, batch 16 (PERF.md v16): Q2_K
// down at 3 blocks (80 registers, 12 bytes of spills) 6.23 → 5.19 ms a step, IQ2_XXS gate/up at
// 3 (80 registers, 60 bytes of spills) −0.1 to −0.25 ms. A bound of 1 lets ptxas take ~150
// registers (one block an SM). The wider formats' decodes would spill more. DNB2: the down
// kernel built for calls of at most 2 rows (moe_downx2; gemvx2 / gemvx4 / moe_downx4 likewise
// for 2 and 4 rows, with xrows_all's groups capped): Q2_K 64 registers and 4 blocks an SM with
// no spills, where moe_downx_q2_k holds 80 and spills 12 bytes (offline sm_90a, PERF.md v24).
// Since v40 (rows as 32-bit offsets, no loop-carried raw words) moe_downx_q2_k fits 64 registers
// with no spills and moe_upx_iq2_xxs 64 with 12 bytes: both at 4 blocks an SM, H100 4 q2 layers,
// batch 64 8.48 → 7.44–7.53 ms a step (at 3: 7.96), batch 16 3.46 → 3.30. Since v41 the Q2_K
// down kernel takes 5 blocks an SM (48 registers; 96 bytes of spill stores, in the 8-row group,
// which an expert of 5 or more pairs takes): its warps wait on their loads (ncu long-scoreboard
// ~6 of ~13 cycles an issue), so 40 warps an SM beat 32 with fewer spills. H100, 4 q2 layers,
// three calls: batch 16 3.25 → 3.18–3.20 ms, batch 64 7.27–7.32 → 7.15–7.21. The IQ2_XXS up
// kernel at 5 (84 bytes of spills) lost: batch 64 7.16 → 7.41–7.50.
X8_KERNELS(F_Q8_0, q8_0, 1, 2, 3)
X8_KERNELS(F_Q2_K, q2_k, 1, 5, 4)
X8_KERNELS(F_IQ2_XXS, iq2_xxs, 4, 3, 4)

// moe_down1s's blocks an SM by its outputs a warp (registers, ptxas 13.5 sm_90a): 1 takes 64
// (4 an SM, no bound needed), 2 80 at 3 an SM, 4 128 at 2 an SM, with no spills in the one-row
// forms (4 bytes in moe_down1sn_q2_k_q8_0; the device's ptxas 13.0 leaves 8–48-byte frames in
// the Q2_K forms). Unbounded, 2 and 4 took 96 and 168 registers (2 and 1 an SM), so the grid's
// waves stayed at ~7.8; bounded they are 5.2 and 3.9 (PERF.md v49: one-row experts 51.0 →
// 46.6 µs from DRAM at 1,4,4). At 8 (only by DSV4_X8_OPW) the bound of 2 spills ~1.6 KB.
#if X8_STAGE_DOWN
#define DOWN1_BOUNDS __launch_bounds__(256, 4)  // the staged rows: one chunk's words held at a time
#elif X8_OPW_DOWN1S >= 4
#define DOWN1_BOUNDS __launch_bounds__(256, 2)
#elif X8_OPW_DOWN1S >= 2
#define DOWN1_BOUNDS __launch_bounds__(256, 3)
#else
#define DOWN1_BOUNDS
#endif

// One or a few rows' routed experts (format R: w1/w3 for up, w2 for down) with the shared
// expert (format S) in two launches; the shared expert's formats of ds4's files (Q8_0) and each format with
// itself (cuda/quant.rs `ffn1_kernels` falls back to the separate launches for any other pair).
// X8_STAGE: moe_up1s with IQ2_XXS gate/up rows at 3 blocks an SM (80 registers; the staged
// form needs ~72, the shared rows' register form ~80). The other forms keep their registers.
// X8_UP1_BLOCKS: that bound (4 would hold the one-row grid's 7 × 64 blocks in one wave of 132
// SMs, at 64 registers; PERF.md v53).
#ifndef X8_UP1_BLOCKS
#define X8_UP1_BLOCKS 3
#endif
#if X8_STAGE_UP && X8_OPW_UP1S <= 4
#define UP1_BOUNDS(R) __launch_bounds__(256, (R) == F_IQ2_XXS ? X8_UP1_BLOCKS : 1)
#else
#define UP1_BOUNDS(R)
#endif
// One form of each (ROWS: n token rows, else one): moe_up1s{,n}_R_S and moe_down1s{,n}_R_S.
#define X8_FFN1_FORM(R, NR, S, NS, SUF, ROWS)                                                                        \
    extern "C" __global__ void UP1_BOUNDS(R) moe_up1s##SUF##_##NR##_##NS(float* h, signed char* hq, float* hd, unsigned* cnt,     \
                                                           const signed char* xq, const float* xd,                  \
                                                           const unsigned* ids, const unsigned long long* ptrs,     \
                                                           const unsigned long long* sptrs, int nexp, int k, int d, \
                                                           int inter, float limit) {                                \
        pdl_enter();                                                                                                 \
        moe_up1s<R, S, ROWS>(h, hq, hd, cnt, xq, xd, ids, ptrs, sptrs, nexp, k, d, inter, limit);                    \
    }                                                                                                                \
    extern "C" __global__ void DOWN1_BOUNDS moe_down1s##SUF##_##NR##_##NS(float* routed, float* shared, float* out, \
                                                             const signed char* hq, const float* hd,                \
                                                             const unsigned* ids, const float* wts,                 \
                                                             const unsigned long long* ptrs,                        \
                                                             const unsigned long long* sptrs, int nexp, int k,      \
                                                             int d, int inter) {                                    \
        pdl_enter();                                                                                                 \
        moe_down1s<R, S, ROWS>(routed, shared, out, hq, hd, ids, wts, ptrs, sptrs, nexp, k, d, inter);               \
    }
#define X8_FFN1_KERNELS(R, NR, S, NS) X8_FFN1_FORM(R, NR, S, NS, , false) X8_FFN1_FORM(R, NR, S, NS, n, true)
X8_FFN1_KERNELS(F_Q8_0, q8_0, F_Q8_0, q8_0)
X8_FFN1_KERNELS(F_Q2_K, q2_k, F_Q8_0, q8_0)
X8_FFN1_KERNELS(F_IQ2_XXS, iq2_xxs, F_Q8_0, q8_0)
X8_FFN1_KERNELS(F_Q2_K, q2_k, F_Q2_K, q2_k)
X8_FFN1_KERNELS(F_IQ2_XXS, iq2_xxs, F_IQ2_XXS, iq2_xxs)

// ---- int8 tensor-core tiles: several rows on `mma` (m16n8k32 / m16n8k16 on s8), bitwise the
// one-row sums.
//
// The one-row kernels (xrows_dot) form output o of a row as: lane l sums its chunks c = 32l +
// 1024i in increasing i (an exact integer dot and one f32 FMA per scale group each), then the
// warp's butterfly adds the 32 lane sums. An mma over one 32-value chunk yields exactly that
// chunk's integer dots for 16 outputs × 8 rows, so a tile reproduces every row's one-row result
// if it keeps the order of the f32 operations: each chunk class l (chunks l, l + 32, ... of 32
// values) is summed on its own in increasing i, and the 32 class sums are added in the
// butterfly's tree. That tree pairs lanes l and l ^ 16 first, then ^ 8, ^ 4, ^ 2, ^ 1: with the
// classes visited in bit-reversed order (class brev5(t) for t = 0..31) it is the plain binary
// tree over t. Each of a block's W warps takes 32 / W consecutive t (a subtree), and the block
// adds the W subtree sums in shared memory in the same tree. Nothing depends on the number of
// rows or on a row's place in the tile, so a row's result is the one-row kernel's at any batch
// (batch invariance), and a verify row equals its decode row.
//
// Fragments (PTX ISA, mma.m16n8k32 .s8; g = lane / 4, t = lane % 4): A (16 outputs × 32 values)
// is {output g's bytes 4t..4t+3, output g+8's, output g's bytes 16+4t.., output g+8's}; B (32
// values × 8 rows) is {row g's bytes 4t.., row g's bytes 16+4t..}; C holds (output g, rows 2t and
// 2t+1) and (output g+8, rows 2t and 2t+1). m16n8k16 takes the first or the second half of A
// and B: Q2_K's two scale groups of 16 values.

__device__ __forceinline__ void mma_k32(int* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                        unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(0));
}

__device__ __forceinline__ void mma_k16(int* d, unsigned a0, unsigned a1, unsigned b0) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%7,%7,%7};"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(a0), "r"(a1), "r"(b0), "r"(0));
}

// One output row's raw words of a chunk for lane t (of its quad): Q8_0 the code words at 4t and
// 16+4t and d; IQ2_XXS the sub-block's two words and its head word; Q2_K the code words at 4t and 16+4t,
// d/dmin and the two groups' scale bytes. Loads only (see XRaw).
struct TRaw {
    unsigned u[4];
};

// The lane's offset within a chunk's codes of one output row (traw's loads): Q8_0 its 8 values at
// 8t, Q2_K its words at 4t and 16 + 4t, IQ2_XXS the whole sub-block (none).
template <int F>
__device__ __forceinline__ int tlane(int t) {
    return F == F_Q8_0 ? 8 * t : F == F_Q2_K ? 4 * t : 0;
}

// traw's loads from wl, the row's codes plus tlane<F>(t) (xtile forms it once a tile).
// A weight word through the read-only path (ld.global.nc: the weights never change while
// kernels run; xtile's row pointers are opaque to the compiler, which would otherwise issue
// generic loads).
template <typename T>
__device__ __forceinline__ T ldw(const u8* p) {
#ifdef __CUDA_ARCH__
    return __ldg((const T*)p);
#else
    return *(const T*)p;
#endif
}

// traw's loads from wl, the row's codes plus tlane<F>(t) (xtile forms it once a tile).
template <int F>
__device__ __forceinline__ TRaw traw_l(const u8* __restrict__ wl, const u8* __restrict__ s, unsigned c) {
    TRaw r;
    if (F == F_Q8_0) {
        uint2 q = ldw<uint2>(wl + c);  // values 8t..8t+7 (see tdec)
        r.u[0] = q.x;
        r.u[1] = q.y;
        r.u[2] = ldw<unsigned short>(s + 2 * (c >> 5));
        r.u[3] = 0;
    } else if (F == F_Q2_K) {
        const u8* b = wl + 64 * (c >> 8) + 32 * ((c & 255) >> 7);
        const u8* hd = s + 20 * (c >> 8);
        r.u[0] = ldw<unsigned>(b);
        r.u[1] = ldw<unsigned>(b + 16);
        r.u[2] = ldw<unsigned>(hd + 16);
        r.u[3] = ldw<unsigned short>(hd + ((c & 255) >> 4));
    } else {  // F_IQ2_XXS
        uint2 q = ldw<uint2>(wl + 8 * (c >> 5));
        r.u[0] = q.x;
        r.u[1] = q.y;
        r.u[2] = ldw<unsigned>(s + 4 * (c >> 7));  // iq2_head
        r.u[3] = 0;
    }
    return r;
}

template <int F>
__device__ __forceinline__ TRaw traw(const u8* __restrict__ w, const u8* __restrict__ s, int c, int t) {
    return traw_l<F>(w + tlane<F>(t), s, c);
}

// The lane's two A words of one output row and the row's scales as xdec32 forms them: d[g] per
// scale group (and Q2_K's min factors m[g]). An integer dot does not depend on the order of its
// terms, so the k of a 32-value mma may be permuted as long as A and B agree: Q8_0 and IQ2_XXS
// give lane t the chunk's values 8t..8t+3 (lo, the fragment's k 4t..) and 8t+4..8t+7 (hi, its k
// 16+4t..), one 8-byte load each for codes and activations, and IQ2_XXS's lane decodes one grid
// entry; Q2_K (two k16 mmas, one per scale group of 16) keeps values 4t.. and 16+4t...
struct TDec {
    unsigned lo, hi;
    float d[2], m[2];
};

template <int F>
__device__ __forceinline__ TDec tdec(const TRaw& r, int c, int t) {
    TDec o;
    if (F == F_Q8_0) {
        o.lo = r.u[0];
        o.hi = r.u[1];
        o.d[0] = h2f((u16)r.u[2]);
    } else if (F == F_Q2_K) {
        int sh = 2 * ((c >> 5) & 3);
        o.lo = (r.u[0] >> sh) & 0x03030303u;
        o.hi = (r.u[1] >> sh) & 0x03030303u;
        q2k_scales(r.u[2], r.u[3], o.d, o.m);
    } else {  // F_IQ2_XXS
        o.d[0] = iq2_scale(r.u[2], c);
        uint2 q = iq2_quads(TAB_SEL(iq2_idx(r.u[0], t)), r.u[1], t);  // values 8t..8t+7
        o.lo = q.x;
        o.hi = q.y;
    }
    return o;
}

__device__ __forceinline__ int brev5(int t) { return (int)(__brev((unsigned)t) >> 27); }

#ifndef XT_CG
#define XT_CG 4  // xtile's classes a pass, at most (1: one class a pass, the chunks of one class ahead)
#endif

// The pointer as an opaque value: ptxas keeps it in its register instead of recomputing it from
// the row index at every use (under register pressure it rematerialised xtile's 64-bit row
// addresses, with the live-row selects, for every chunk).
template <typename T>
__device__ __forceinline__ void keep_reg(T*& p) {
#ifdef __CUDA_ARCH__
    asm volatile("" : "+l"(p));
#endif
}

// The tiles' class tree (xtile, gemvt_cp). A warp's pass ends with its CG class sums acc[0..CG]
// (consecutive t from a multiple of CG: a subtree): they are added in the tree, then pushed as
// leaf `pass` of the passes' tree, a binary counter over stk; after the last pass, sub holds the
// warp's subtree sum. pass is a constant where this is inlined (an unrolled loop), so every
// branch and index is resolved at compile time.
template <int CG, int P, int NT, int PASSES, int LV>
__device__ __forceinline__ void tile_push(float (&acc)[CG][P][NT][4], float (&stk)[LV > 0 ? LV : 1][P][NT][4],
                                          float (&sub)[P][NT][4], int pass) {
#pragma unroll
    for (int st = 1; st < CG; st *= 2)
#pragma unroll
        for (int q = 0; q < CG; q += 2 * st)
#pragma unroll
            for (int p = 0; p < P; p++)
#pragma unroll
                for (int j = 0; j < NT; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) acc[q][p][j][e] = acc[q][p][j][e] + acc[q + st][p][j][e];
    int l = 0;
#pragma unroll
    for (; l < LV; l++) {
        if (!((pass >> l) & 1)) break;
#pragma unroll
        for (int p = 0; p < P; p++)
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[0][p][j][e] = stk[l][p][j][e] + acc[0][p][j][e];
    }
#pragma unroll
    for (int p = 0; p < P; p++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                if (pass == PASSES - 1) sub[p][j][e] = acc[0][p][j][e];
                else stk[l < LV ? l : 0][p][j][e] = acc[0][p][j][e];
            }
}

// Then the block's W warps' subtree sums (in class order) through red (W·P·16·8·NT floats) in
// the tree: neighbours, pairs of pairs, ...; store(o, r, v) gets v[0..P] of every output o < m
// and tile row r < nrows, from one thread. Every thread of the block calls it (barriers).
template <int P, int NT, int W, typename ST>
__device__ __forceinline__ void tile_reduce(const float (&sub)[P][NT][4], float* red, int o0, int m, int nrows,
                                            ST store) {
    constexpr int NR = 8 * NT;
    int wp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int p = 0; p < P; p++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int oo = g + 8 * (e >> 1), rr = 8 * j + 2 * t + (e & 1);
                red[((wp * P + p) * 16 + oo) * NR + rr] = sub[p][j][e];
            }
    __syncthreads();
    for (int i = threadIdx.x; i < 16 * NR; i += 32 * W) {
        int oo = i / NR, rr = i % NR;
        float v[P];
#pragma unroll
        for (int p = 0; p < P; p++) {
            float a[W];
#pragma unroll
            for (int q = 0; q < W; q++) a[q] = red[((q * P + p) * 16 + oo) * NR + rr];
#pragma unroll
            for (int st = 1; st < W; st *= 2)
#pragma unroll
                for (int q = 0; q < W; q += 2 * st) a[q] = a[q] + a[q + st];
            v[p] = a[0];
        }
        if (o0 + oo < m && rr < nrows) store(o0 + oo, rr, v);
    }
    __syncthreads();  // red is free again
}

// The 16-output tile at o0 (outputs past m: the last row again, not stored) of P weight matrices
// (codes w[p], heads s[p], k values a row) against the same 8·NT activation rows. xrow(r, q, d)
// gives tile row r's int8 codes and block scales (r < nrows: a row past the tile's live rows
// reads the last live one, whose sums there are not stored). store(o, r, v) gets v[0..P] of
// every output o < m and tile row r < nrows, from one thread. W warps take 32 / W consecutive
// classes t each (a subtree of the butterfly's tree), CG classes a pass with U chunks loaded
// ahead; a warp adds its classes' sums in registers in the tree's order (within a pass, then
// the passes as a binary counter), `red` (W·P·16·8·NT floats) takes the W subtree sums, and the
// block adds them in the tree. Every thread of the block must call it (barriers).
template <int F, int NT, int P, int W, int U, typename XR, typename ST>
__device__ __forceinline__ void xtile(const u8* const* w, const u8* const* s, int o0, int m, int k, XR xrow, int nrows,
                                      ST store, float* red) {
    constexpr int NR = 8 * NT;
    int wp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    // The lane's row pointers, its offsets folded in once (the loads then add only the chunk's
    // offset; recomputing 64-bit row addresses a chunk was most of the loop's instructions).
    const u8* wr[P][2];
    const u8* sr[P][2];
#pragma unroll
    for (int p = 0; p < P; p++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int o = min(o0 + g + 8 * h, m - 1);
            wr[p][h] = w[p] + (long long)o * row_bytes(F, k) + tlane<F>(t);
            sr[p][h] = scale_row(F, s[p], o, k);
        }
    // Per n-tile: row g's codes at the lane's offset and its block scales (this lane's B words;
    // the scales of C's columns, rows 2t and 2t+1, come from lanes 8t and 8t + 4 by shuffles).
    const signed char* bq[NT];
    const float* bd[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) {
        xrow(min(8 * j + g, nrows - 1), bq[j], bd[j]);
        bq[j] += (F == F_Q2_K ? 4 : 8) * t;
        keep_reg(bq[j]);
        keep_reg(bd[j]);
    }
#pragma unroll
    for (int p = 0; p < P; p++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            keep_reg(wr[p][h]);
            keep_reg(sr[p][h]);
        }
    // CG of the warp's classes a pass, each with its own sums, and UU chunks of each loaded ahead:
    // a batch's U = CG·UU chunks are in flight together whatever the chunks a class (k = 1024,
    // wq_b: one chunk a class). A class's chunks are still added in their order.
    constexpr int CW = 32 / W, CG0 = XT_CG < U ? XT_CG : U, CG = CG0 < CW ? CG0 : CW, UU = U / CG;
    constexpr int PASSES = CW / CG, LV = PASSES >= 4 ? 2 : PASSES >= 2 ? 1 : 0;
    static_assert(CW % CG == 0 && U % CG == 0 && PASSES <= 4, "a pass takes whole classes and whole chunk steps");
    float stk[LV > 0 ? LV : 1][P][NT][4];  // the passes' pending left subtrees
    float sub[P][NT][4];                    // the warp's subtree sum
#pragma unroll
    for (int pass = 0; pass < PASSES; pass++) {
        int tb = wp * CW + pass * CG;
        unsigned cl[CG];
        float acc[CG][P][NT][4];
#pragma unroll
        for (int q = 0; q < CG; q++) {
            cl[q] = 32 * brev5(tb + q);
#pragma unroll
            for (int p = 0; p < P; p++)
#pragma unroll
                for (int j = 0; j < NT; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) acc[q][p][j][e] = 0.f;
        }
#pragma unroll 1
        for (unsigned i0 = 0; i0 < (unsigned)k; i0 += 1024 * UU) {
            // Slot v = u·CG + q: class q's chunk at cl[q] + i0 + 1024·u.
            TRaw raw[U][P][2];
            unsigned bw[U][NT][2];
            float dx[U][NT][2];
#pragma unroll
            for (int v = 0; v < U; v++) {
                unsigned c = cl[v % CG] + i0 + 1024 * (v / CG);
                if (c < (unsigned)k) {
#pragma unroll
                    for (int p = 0; p < P; p++)
#pragma unroll
                        for (int h = 0; h < 2; h++) raw[v][p][h] = traw_l<F>(wr[p][h], sr[p][h], c);
#pragma unroll
                    for (int j = 0; j < NT; j++) {
                        if (F == F_Q2_K) {
                            bw[v][j][0] = *(const unsigned*)(bq[j] + c);
                            bw[v][j][1] = *(const unsigned*)(bq[j] + c + 16);
                        } else {
                            uint2 b = *(const uint2*)(bq[j] + c);
                            bw[v][j][0] = b.x;
                            bw[v][j][1] = b.y;
                        }
                        dx[v][j][0] = bd[j][c >> 5];  // row g's; see below
                    }
                }
            }
#pragma unroll
            for (int v = 0; v < U; v++) {
                const int q = v % CG;
                unsigned c = cl[q] + i0 + 1024 * (v / CG);
                if (c >= (unsigned)k) continue;  // warp-uniform
#pragma unroll
                for (int j = 0; j < NT; j++) {  // C's columns: rows 2t and 2t+1
                    float dg = dx[v][j][0];
                    dx[v][j][0] = __shfl_sync(0xffffffffu, dg, 8 * t);
                    dx[v][j][1] = __shfl_sync(0xffffffffu, dg, 8 * t + 4);
                }
#pragma unroll
                for (int p = 0; p < P; p++) {
                    TDec a0 = tdec<F>(raw[v][p][0], c, t), a1 = tdec<F>(raw[v][p][1], c, t);
#pragma unroll
                    for (int j = 0; j < NT; j++) {
                        if (F == F_Q2_K) {
                            // Per group, xapply32's order: d·dx times the codes' dot, then −m·dx
                            // times the sum of the row's codes (rows 2t, 2t+1's sums come from
                            // the quads holding those rows' B words).
#pragma unroll
                            for (int gi = 0; gi < 2; gi++) {
                                int is[4];
                                mma_k16(is, gi ? a0.hi : a0.lo, gi ? a1.hi : a1.lo, bw[v][j][gi]);
                                int xs = __dp4a(0x01010101, (int)bw[v][j][gi], 0);
                                xs += __shfl_xor_sync(0xffffffffu, xs, 1);
                                xs += __shfl_xor_sync(0xffffffffu, xs, 2);
                                int xs0 = __shfl_sync(0xffffffffu, xs, 8 * t);
                                int xs1 = __shfl_sync(0xffffffffu, xs, 8 * t + 4);
#pragma unroll
                                for (int e = 0; e < 4; e++) {
                                    const TDec& a = e < 2 ? a0 : a1;
                                    float dxe = dx[v][j][e & 1], r = acc[q][p][j][e];
                                    r = __fmaf_rn(__fmul_rn(dxe, a.d[gi]), i2f_small(is[e]), r);
                                    r = __fmaf_rn(-__fmul_rn(dxe, a.m[gi]), i2f_small((e & 1) ? xs1 : xs0), r);
                                    acc[q][p][j][e] = r;
                                }
                            }
                        } else {
                            int is[4];
                            mma_k32(is, a0.lo, a1.lo, a0.hi, a1.hi, bw[v][j][0], bw[v][j][1]);
#pragma unroll
                            for (int e = 0; e < 4; e++) {
                                const TDec& a = e < 2 ? a0 : a1;
                                acc[q][p][j][e] = __fmaf_rn(__fmul_rn(a.d[0], dx[v][j][e & 1]), i2f_small(is[e]),
                                                            acc[q][p][j][e]);
                            }
                        }
                    }
                }
            }
        }
        tile_push<CG, P, NT, PASSES, LV>(acc, stk, sub, pass);
    }
    tile_reduce<P, NT, W>(sub, red, o0, m, nrows, store);
}

// With rounds (DSV4_TILE_ROUNDS): a block's next output tile, rows on .. on + 16 of each of the
// np weight matrices (codes w[p], heads s[p], k values a row), asked of L2 by threads 0..2·np − 1
// before this tile's work, so that the next tile's loads meet L2 while this one's mma and class
// tree run (a tile kernel's block holds ~17 KB of weights in flight only while it loads them:
// gemvt28 on wq_b ran at 0.83 TB/s, PERF.md v28). A hint changes no value.
template <int F, int NP>
__device__ __forceinline__ void tile_hint(const u8* const* w, const u8* const* s, int on, int m, int k) {
    int i = threadIdx.x;
    if (on >= m || i >= 2 * NP) return;
    bool second = NP > 1 && i >= 2;  // selects, not w[i >> 1]: a runtime index puts w in local memory
    const u8* wi = second ? w[NP - 1] : w[0];
    const u8* si = second ? s[NP - 1] : s[0];
    long long rows = min(16, m - on), rb = (i & 1) ? head_bytes(F, k) : row_bytes(F, k);
    l2_hint((i & 1) ? scale_row(F, si, on, k) : wi + (long long)on * row_bytes(F, k), rows * rb);
}

// ---- The dense Q8_0 tiles on cp.async (PERF.md v29: xtile held a warp's chunks in registers,
// 2 KB of weights a warp in flight during its loads and none while it decoded and waited on the
// block's barrier; wq_b ran at ~1.2 TB/s on the H100). Each warp copies its batches (U chunk
// slots of xtile's classes) into its own ring of XTC_ST stages in dynamic shared memory: the
// weight codes of the tile's 16 rows, the 4-byte words holding their scales, the activation
// rows' codes and scales. The next batch (of this tile, or of the block's next tile) is in flight
// while this one is decoded and across the tile's barrier. The operations on the words and their
// order are xtile's, so every value is the same.
#ifndef XTC_ST
#define XTC_ST 2  // stages a warp's ring
#endif
#define XTC_U 4  // chunk slots a stage

// Bytes of one slot: the weight codes (16 rows × 32), the rows' scale words (16 × 4), the
// activation codes (8·NT rows × 32) and scales (8·NT × 4).
__host__ __device__ constexpr int xtc_slot(int nt) { return 512 + 64 + 32 * 8 * nt + 4 * 8 * nt; }

__device__ __forceinline__ void xtc_cp16(const void* dst, const void* src) {
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void xtc_cp4(const void* dst, const void* src) {
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void xtc_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void xtc_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(XTC_ST - 1) : "memory"); }

// gemvt_x8 for Q8_0 (k / 32 even: a scale pair's word is 4-byte aligned) with the dynamic shared
// memory W·XTC_ST·XTC_U·xtc_slot(NT) bytes (the launcher's `xtc_smem`); red: W·16·8·NT floats.
template <int NT, int W>
__device__ void gemvt_cp(float* __restrict__ out, const signed char* __restrict__ xq, const float* __restrict__ xd,
                         const u8* __restrict__ w, const u8* __restrict__ s, int n, int k, int m, int ldx, int rpg,
                         float* red) {
    extern __shared__ __align__(16) unsigned char xtc_ring[];
    constexpr int NR = 8 * NT, U = XTC_U, SB = xtc_slot(NT);
    constexpr int CW = 32 / W, CG0 = XT_CG < U ? XT_CG : U, CG = CG0 < CW ? CG0 : CW, UU = U / CG;
    constexpr int PASSES = CW / CG, LV = PASSES >= 4 ? 2 : PASSES >= 2 ? 1 : 0;
    static_assert(CW % CG == 0 && U % CG == 0 && PASSES <= 4, "a pass takes whole classes and whole chunk steps");
    int wp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int r0 = blockIdx.x * NR, nrows = n - r0;
    long long rb = row_bytes(F_Q8_0, k), hb = head_bytes(F_Q8_0, k);
    unsigned char* ring = xtc_ring + wp * XTC_ST * U * SB;
    const int nb = (k + 1024 * UU - 1) / (1024 * UU);  // batches a pass
    const int ostep = gridDim.y * 16;
    // The issue cursor: the next batch to copy (tile io, pass ip, batch ib) and its stage.
    int io = blockIdx.y * 16, ip = 0, ib = 0, ist = 0;
    auto issue = [&]() {
        if (io < m) {
            unsigned char* base = ring + ist * U * SB;
            long long xoff = (long long)(io / rpg) * k;
            const u8* wa = w + min(io + (lane >> 1), m - 1) * rb + 16 * (lane & 1);
            const u8* sa = s + min(io + (lane & 15), m - 1) * hb;
            long long xr = (long long)(r0 + min(lane >> 1, nrows - 1)) * ldx + xoff;
            const signed char* xb = xq + xr + 16 * (lane & 1);
            const float* db = xd + ((long long)(r0 + min(lane & (NR - 1), nrows - 1)) * ldx + xoff) / 32;
#pragma unroll
            for (int v = 0; v < U; v++) {
                unsigned c = 32 * brev5(wp * CW + ip * CG + v % CG) + ib * 1024 * UU + 1024 * (v / CG);
                if (c < (unsigned)k) {
                    unsigned char* sl = base + v * SB;
                    xtc_cp16(sl + 32 * (lane >> 1) + 16 * (lane & 1), wa + c);
                    if (lane < 16) xtc_cp4(sl + 512 + 4 * lane, sa + 2 * ((c >> 5) & ~1u));
                    if ((lane >> 1) < NR) xtc_cp16(sl + 576 + 32 * (lane >> 1) + 16 * (lane & 1), xb + c);
                    if (lane < NR) xtc_cp4(sl + 576 + 32 * NR + 4 * lane, db + (c >> 5));
                }
            }
            if (++ib == nb) {
                ib = 0;
                if (++ip == PASSES) ip = 0, io += ostep;
            }
        }
        xtc_commit();  // (empty past the last tile: every wait counts the same groups)
        ist = ist + 1 == XTC_ST ? 0 : ist + 1;
    };
#pragma unroll
    for (int i = 0; i < XTC_ST - 1; i++) issue();
    int cst = 0;  // the stage of the batch decoded next
#pragma unroll 1
    for (int o0 = blockIdx.y * 16; o0 < m; o0 += ostep) {
        float stk[LV > 0 ? LV : 1][1][NT][4];
        float sub[1][NT][4];
#pragma unroll
        for (int pass = 0; pass < PASSES; pass++) {
            int tb = wp * CW + pass * CG;
            unsigned cl[CG];
            float acc[CG][1][NT][4];
#pragma unroll
            for (int q = 0; q < CG; q++) {
                cl[q] = 32 * brev5(tb + q);
#pragma unroll
                for (int j = 0; j < NT; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) acc[q][0][j][e] = 0.f;
            }
#pragma unroll 1
            for (int b = 0; b < nb; b++) {
                issue();
                xtc_wait();
                __syncwarp();
                const unsigned char* base = ring + cst * U * SB;
                unsigned i0 = b * 1024 * UU;
#pragma unroll
                for (int v = 0; v < U; v++) {
                    const int q = v % CG;
                    unsigned c = cl[q] + i0 + 1024 * (v / CG);
                    if (c >= (unsigned)k) continue;  // warp-uniform
                    const unsigned char* sl = base + v * SB;
                    // tdec's Q8_0 words of rows g and g + 8 (values 8t..8t+7) and their scales.
                    uint2 a0 = *(const uint2*)(sl + 32 * g + 8 * t), a1 = *(const uint2*)(sl + 32 * (g + 8) + 8 * t);
                    int sh = 16 * ((c >> 5) & 1);
                    float d0 = h2f((u16)(*(const unsigned*)(sl + 512 + 4 * g) >> sh));
                    float d1 = h2f((u16)(*(const unsigned*)(sl + 512 + 4 * (g + 8)) >> sh));
#pragma unroll
                    for (int j = 0; j < NT; j++) {
                        uint2 bw = *(const uint2*)(sl + 576 + 32 * (8 * j + g) + 8 * t);
                        const float* dxs = (const float*)(sl + 576 + 32 * NR) + 8 * j + 2 * t;
                        float dx[2] = {dxs[0], dxs[1]};  // C's columns: rows 2t and 2t+1
                        int is[4];
                        mma_k32(is, a0.x, a1.x, a0.y, a1.y, bw.x, bw.y);
#pragma unroll
                        for (int e = 0; e < 4; e++)
                            acc[q][0][j][e] =
                                __fmaf_rn(__fmul_rn(e < 2 ? d0 : d1, dx[e & 1]), i2f_small(is[e]), acc[q][0][j][e]);
                    }
                }
                __syncwarp();  // the stage is read before a later issue() overwrites it
                cst = cst + 1 == XTC_ST ? 0 : cst + 1;
            }
            tile_push<CG, 1, NT, PASSES, LV>(acc, stk, sub, pass);
        }
        tile_reduce<1, NT, W>(sub, red, o0, m, nrows,
                              [&](int o, int r, const float* v) { out[(long long)(r0 + r) * m + o] = v[0]; });
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
}

// out[r, o] for n rows on tensor-core tiles (see gemvn_x8: the same results); grid (row tiles of
// 8·NT, output tiles of 16). rpg a multiple of 16 (a tile's outputs share their activations).
template <int F, int NT, int W>
__device__ void gemvt_x8(float* __restrict__ out, const signed char* __restrict__ xq, const float* __restrict__ xd,
                         const u8* __restrict__ w, const u8* __restrict__ s, int n, int k, int m, int ldx, int rpg) {
    __shared__ float red[W * 16 * 8 * NT];
    int r0 = blockIdx.x * 8 * NT;
    const u8* wp[1] = {w};
    const u8* sp[1] = {s};
    // Output tiles o0, o0 + 16·gridDim.y, ... (DSV4_TILE_ROUNDS: a block's setup paid once for several).
#pragma unroll 1
    for (int o0 = blockIdx.y * 16; o0 < m; o0 += gridDim.y * 16) {
        tile_hint<F, 1>(wp, sp, o0 + gridDim.y * 16, m, k);
        long long xoff = (long long)(o0 / rpg) * k;
        xtile<F, NT, 1, W, 4>(
            wp, sp, o0, m, k,
            [&](int r, const signed char*& q, const float*& d) {
                bool live = r0 + r < n;
                long long e = (long long)(r0 + r) * ldx + xoff;
                q = live ? xq + e : nullptr;
                d = live ? xd + e / 32 : nullptr;
            },
            n - r0, [&](int o, int r, const float* v) { out[(long long)(r0 + r) * m + o] = v[0]; }, red);
    }
}

// Routed experts of several token rows on tensor-core tiles (see moe_upn_x8: the same results):
// block (x-th active expert, 16 outputs), the expert's pairs in row tiles of 8·NT; gate and up
// share the activations' fragments.
template <int F, int NT, int W>
__device__ void moe_upt_x8(float* __restrict__ h, const signed char* __restrict__ xq, const float* __restrict__ xd,
                           const unsigned* order, const unsigned* off, const unsigned* active,
                           const unsigned long long* ptrs, int nexp, int k, int d, int inter, float limit) {
    __shared__ float red[W * 2 * 16 * 8 * NT];
    if (blockIdx.x >= active[nexp]) return;  // uniform in the block
    unsigned e = active[blockIdx.x];
    const u8* wp[2] = {(const u8*)ptrs[e], (const u8*)ptrs[nexp + e]};
    const u8* sp[2] = {(const u8*)ptrs[3 * nexp + e], (const u8*)ptrs[4 * nexp + e]};
    unsigned b0 = off[e];
    int cnt = (int)(off[e + 1] - b0);
    // Output tiles o0, o0 + 16·gridDim.y, ... (DSV4_TILE_ROUNDS, as gemvt_x8).
#pragma unroll 1
    for (int o0 = blockIdx.y * 16; o0 < inter; o0 += gridDim.y * 16) {
        tile_hint<F, 2>(wp, sp, o0 + gridDim.y * 16, inter, d);
        for (int r0 = 0; r0 < cnt; r0 += 8 * NT) {
            xtile<F, NT, 2, W, 2>(
                wp, sp, o0, inter, d,
                [&](int r, const signed char*& q, const float*& s) {
                    bool live = r0 + r < cnt;
                    long long tk = live ? order[b0 + r0 + r] / k : 0;
                    q = live ? xq + tk * d : nullptr;
                    s = live ? xd + tk * d / 32 : nullptr;
                },
                cnt - r0,
                [&](int o, int r, const float* v) {
                    h[(long long)order[b0 + r0 + r] * inter + o] = swiglu_q(v[0], v[1], limit);
                },
                red);
        }
    }
}

template <int F, int NT, int W>
__device__ void moe_downt_x8(float* __restrict__ y, const signed char* __restrict__ hq, const float* __restrict__ hd,
                             const unsigned* order, const unsigned* off, const unsigned* active,
                             const unsigned long long* ptrs, int nexp, int d, int inter) {
    __shared__ float red[W * 16 * 8 * NT];
    if (blockIdx.x >= active[nexp]) return;  // uniform in the block
    unsigned e = active[blockIdx.x];
    const u8* wp[1] = {(const u8*)ptrs[2 * nexp + e]};
    const u8* sp[1] = {(const u8*)ptrs[5 * nexp + e]};
    unsigned b0 = off[e];
    int cnt = (int)(off[e + 1] - b0);
#pragma unroll 1
    for (int o0 = blockIdx.y * 16; o0 < d; o0 += gridDim.y * 16) {  // rounds as moe_upt_x8
        tile_hint<F, 1>(wp, sp, o0 + gridDim.y * 16, d, inter);
        for (int r0 = 0; r0 < cnt; r0 += 8 * NT) {
            xtile<F, NT, 1, W, 2>(
                wp, sp, o0, d, inter,
                [&](int r, const signed char*& q, const float*& s) {
                    bool live = r0 + r < cnt;
                    long long pr = live ? order[b0 + r0 + r] : 0;
                    q = live ? hq + pr * inter : nullptr;
                    s = live ? hd + pr * inter / 32 : nullptr;
                },
                cnt - r0, [&](int o, int r, const float* v) { y[(long long)order[b0 + r0 + r] * d + o] = v[0]; },
                red);
        }
    }
}

// Warps an SM the tile kernels are built to hold (__launch_bounds__'s minimum blocks: 256 / (32·W)
// blocks of 32·W threads cap a thread at 65536 / 256 = 256 / 8... registers; 0: no minimum). At
// the default the dense tiles took 98–124 registers: 2 blocks of 8 warps an SM, 1 of 16.
#ifndef TILE_WARPS_SM
#define TILE_WARPS_SM 0
#endif
#if TILE_WARPS_SM > 0
#define TILE_BOUNDS(W) __launch_bounds__(32 * (W), TILE_WARPS_SM / (W))
#else
#define TILE_BOUNDS(W) __launch_bounds__(32 * (W))
#endif

// Tile kernels: gemvt_{n}{w}_F (NT = n n-tiles of 8 rows, w warps), moe_upt_F, moe_downt_F.
#define TILE_GEMV(F, N, NT, W)                                                                                       \
    extern "C" __global__ void TILE_BOUNDS(W) gemvt##NT##W##_##N(                                                    \
        float* out, const signed char* xq, const float* xd, const u8* w, const u8* s, int n, int k, int m, int ldx, \
        int rpg) {                                                                                                   \
        pdl_enter();                                                                                                 \
        fill_tabs<F, false>();                                                                                        \
        gemvt_x8<F, NT, W>(out, xq, xd, w, s, n, k, m, ldx, rpg);                                                    \
    }

// The cp.async dense tiles (Q8_0): gemvtc_{n}{w}_q8_0, the same arguments and grid as gemvt's.
#define TILE_GEMV_CP(NT, W)                                                                                          \
    extern "C" __global__ void TILE_BOUNDS(W) gemvtc##NT##W##_q8_0(                                                  \
        float* out, const signed char* xq, const float* xd, const u8* w, const u8* s, int n, int k, int m, int ldx, \
        int rpg) {                                                                                                   \
        __shared__ float red[W * 16 * 8 * NT];                                                                       \
        pdl_enter();                                                                                                 \
        gemvt_cp<NT, W>(out, xq, xd, w, s, n, k, m, ldx, rpg, red);                                                 \
    }
TILE_GEMV_CP(1, 8)
TILE_GEMV_CP(2, 8)
TILE_GEMV_CP(1, 16)
TILE_GEMV_CP(2, 16)

#define TILE_KERNELS(F, N)                                                                                           \
    TILE_GEMV(F, N, 1, 8)                                                                                            \
    TILE_GEMV(F, N, 2, 8)                                                                                            \
    TILE_GEMV(F, N, 1, 16)                                                                                           \
    TILE_GEMV(F, N, 2, 16)                                                                                           \
    extern "C" __global__ void TILE_BOUNDS(8) moe_upt_##N(                                                                                                             \
        float* h, const signed char* xq, const float* xd, const unsigned* order, const unsigned* off,               \
        const unsigned* active, const unsigned long long* ptrs, int nexp, int k, int d, int inter, float limit) {    \
        pdl_enter();                                                                                                 \
        fill_tabs<F, false>();                                                                                        \
        moe_upt_x8<F, 1, 8>(h, xq, xd, order, off, active, ptrs, nexp, k, d, inter, limit);                          \
    }                                                                                                                \
    extern "C" __global__ void TILE_BOUNDS(8) moe_downt_##N(                                                                                                         \
        float* y, const signed char* hq, const float* hd, const unsigned* order, const unsigned* off,               \
        const unsigned* active, const unsigned long long* ptrs, int nexp, int d, int inter) {                        \
        pdl_enter();                                                                                                 \
        fill_tabs<F, false>();                                                                                        \
        moe_downt_x8<F, 1, 8>(y, hq, hd, order, off, active, ptrs, nexp, d, inter);                                  \
    }

TILE_KERNELS(F_Q8_0, q8_0)
TILE_KERNELS(F_Q2_K, q2_k)
TILE_KERNELS(F_IQ2_XXS, iq2_xxs)

// out[i, :] = f32(table[idx[i], :]) for a bf16 table (the embedding).
extern "C" __global__ void gather_bf16(float* out, const u16* table, const unsigned* idx, int n, int cols) {
    pdl_enter();
    GRID_STRIDE(e, (long long)n * cols) {
        long long i = e / cols, c = e % cols;
        out[e] = __uint_as_float(((unsigned)table[(long long)idx[i] * cols + c]) << 16);
    }
}

__device__ __forceinline__ unsigned long long mix64q(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Random valid blocks for synthetic checkpoints: bytes from a counter hash; FP8 bytes keep
// exponents 4..10 (values 2^-3..2^3, never NaN). Then `patch_blocks` writes the f16 scale
// fields of every block.
extern "C" __global__ void rand_bytes(u8* w, long long n, int fp8, unsigned long long seed) {
    pdl_enter();
    GRID_STRIDE(i, n) {
        unsigned r = (unsigned)mix64q(seed * 0x9E3779B97F4A7C15ull + i);
        u8 b = r & 255;
        if (fp8) b = (u8)((b & 0x87) | ((4 + (r >> 8) % 7) << 3));
        w[i] = b;
    }
}

// IQ2_XXS code planes of random bytes made GGUF blocks again (iq2_even_signs on each of the n
// sub-blocks' sign words, the second word of 8 bytes).
extern "C" __global__ void iq2_even_signs_k(u8* w, long long n) {
    pdl_enter();
    GRID_STRIDE(i, n) {
        unsigned* sg = (unsigned*)(w + 8 * i + 4);
        *sg = iq2_even_signs(*sg);
    }
}

// For each block: the u16 at byte off1 := v1, and at off2 := v2 when off2 >= 0.
extern "C" __global__ void patch_blocks(u8* w, long long nblocks, int block_bytes, int off1, unsigned v1, int off2,
                                        unsigned v2) {
    pdl_enter();
    GRID_STRIDE(i, nblocks) {
        u8* b = w + i * block_bytes;
        *(u16*)(b + off1) = (u16)v1;
        if (off2 >= 0) *(u16*)(b + off2) = (u16)v2;
    }
}

extern "C" __global__ void fill_u8(u8* w, long long n, unsigned v) {
    pdl_enter();
    GRID_STRIDE(i, n) w[i] = (u8)v;
}
