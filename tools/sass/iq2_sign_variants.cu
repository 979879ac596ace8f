// IQ2_XXS decode variants for instruction counts only (not built by the backend):
//   python3 tools/kernel_sass.py --cuda /tmp/cuda-tools/nvidia/cu13 tools/sass/iq2_sign_variants.cu v0 v1 v2 v3
// One 32-value chunk of one weight row against one row of int8 activations a loop iteration
// (loads and loop included). ptxas 13.5 for sm_90a, 2026-12-03 (PERF.md v16):
//   v0 the kernels' decode (popc parity, nibble_bytes masks)            107 instructions
//   v1 sign masks by PRMT sign replication                               103
//   v2 v1 and the sign fix as a second dp4a accumulator                   96
//   v3 a repacked sign word (quad q's signs at bits 8i + 7 − q, parity   79
//      stored): one SHF and one PRMT a quad's mask
// The values are not checked here (the GRIDT table is zeros); only the code shape matters.
__device__ const unsigned long long GRIDT[256] = {0};
__device__ __forceinline__ unsigned iq2_signs(unsigned i7) { return i7 | ((__popc(i7) & 1u) << 7); }
__device__ __forceinline__ unsigned nibble_bytes(unsigned n) { return (n * 0x00204081u) & 0x01010101u; }
// PRMT with sign replication (selector 0xBA98). Not `__byte_perm`, which keeps 3 bits of each
// selector nibble: NVRTC turned its 0xBA98 into 0x3210 (the counts above were taken so; the
// instruction counts are the same).
__device__ __forceinline__ unsigned sgn(unsigned x) {
    unsigned m;
    asm("prmt.b32 %0, %1, 0, 0xBA98;" : "=r"(m) : "r"(x));
    return m;
}

template <int V>
__device__ __forceinline__ int dec_dot(unsigned a, unsigned sg, const int* x, const unsigned long long* G, int& ns) {
    int is = 0;
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        unsigned long long grid = G[(a >> (8 * kk)) & 255];
        unsigned g0 = (unsigned)grid, g1 = (unsigned)(grid >> 32);
        if (V == 0) {  // current
            unsigned sb = iq2_signs((sg >> (7 * kk)) & 127);
            unsigned blo = nibble_bytes(sb & 15u), bhi = nibble_bytes(sb >> 4);
            is = __dp4a((int)((g0 ^ (blo * 255u)) + blo), x[2 * kk], is);
            is = __dp4a((int)((g1 ^ (bhi * 255u)) + bhi), x[2 * kk + 1], is);
        } else if (V == 1 || V == 2) {  // PRMT sign replication; V 2: the sign fix by a second dp4a
            unsigned s7 = (sg >> (7 * kk)) & 127;
            unsigned mlo = sgn((s7 & 15u) * 0x10204080u);
            unsigned hi = (s7 & 0x70u) * 0x01020408u + ((unsigned)__popc(s7) << 31);
            unsigned mhi = sgn(hi);
            if (V == 1) {
                is = __dp4a((int)((g0 ^ mlo) + (mlo & 0x01010101u)), x[2 * kk], is);
                is = __dp4a((int)((g1 ^ mhi) + (mhi & 0x01010101u)), x[2 * kk + 1], is);
            } else {
                is = __dp4a((int)(g0 ^ mlo), x[2 * kk], is);
                is = __dp4a((int)(g1 ^ mhi), x[2 * kk + 1], is);
                ns = __dp4a((int)mlo, x[2 * kk], ns);
                ns = __dp4a((int)mhi, x[2 * kk + 1], ns);
            }
        } else {  // V 3: a sign word with quad q's 4 signs at bits 8i + 7 - q (parity stored)
            unsigned mlo = sgn(sg << (2 * kk));
            unsigned mhi = sgn(sg << (2 * kk + 1));
            is = __dp4a((int)((g0 ^ mlo) + (mlo & 0x01010101u)), x[2 * kk], is);
            is = __dp4a((int)((g1 ^ mhi) + (mhi & 0x01010101u)), x[2 * kk + 1], is);
        }
    }
    return is;
}

template <int V>
__device__ void body(float* out, const unsigned char* w, const signed char* xq, int k) {
    __shared__ unsigned long long S[256];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) S[i] = GRIDT[i];
    __syncthreads();
    int lane = threadIdx.x & 31;
    float acc = 0.f;
#pragma unroll 1
    for (int c = lane * 32; c < k; c += 1024) {
        uint2 q = *(const uint2*)(w + 8 * (c >> 5));
        int4 a = *(const int4*)(xq + c), b = *(const int4*)(xq + c + 16);
        int x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        int ns = 0;
        int is = dec_dot<V>(q.x, q.y, x, S, ns);
        acc += (float)(is - ns) * (float)(q.y >> 28);
    }
    if (lane == 0) out[threadIdx.x >> 5] = acc;
}
extern "C" __global__ void v0(float* o, const unsigned char* w, const signed char* x, int k) { body<0>(o, w, x, k); }
extern "C" __global__ void v1(float* o, const unsigned char* w, const signed char* x, int k) { body<1>(o, w, x, k); }
extern "C" __global__ void v2(float* o, const unsigned char* w, const signed char* x, int k) { body<2>(o, w, x, k); }
extern "C" __global__ void v3(float* o, const unsigned char* w, const signed char* x, int k) { body<3>(o, w, x, k); }
