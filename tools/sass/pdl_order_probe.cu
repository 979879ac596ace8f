// Where ptxas puts PDL's wait (`griddepcontrol.wait`, SASS ACQBULK) relative to loads issued
// before it in the source: `va` (a __syncthreads between) and `vc` (nothing between) get the
// wait hoisted above the load; `vb` (two predicated waits on a loaded value) keeps the load
// first. Hence common.cuh's `pdl_enter_after`. Offline:
//   SASS_FULL=1 python3 tools/kernel_sass.py --cuda /tmp/cuda-tools/nvidia/cu13 \
//       tools/sass/pdl_order_probe.cu va vb vc 2>&1 >/dev/null | grep -E "LDG|ACQBULK"
__device__ __forceinline__ uint4 ldg_stream(const unsigned short* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
extern "C" __global__ void va(float* out, const unsigned short* w, const float* x) {
    uint4 a = ldg_stream(w + threadIdx.x * 8);
    __syncthreads();
    asm volatile("griddepcontrol.wait;" ::: "memory");
    out[threadIdx.x] = x[threadIdx.x] * __uint_as_float(a.x) + __uint_as_float(a.y);
}
extern "C" __global__ void vb(float* out, const unsigned short* w, const float* x, unsigned magic) {
    uint4 a = ldg_stream(w + threadIdx.x * 8);
    asm volatile("{\n .reg .pred p;\n setp.eq.u32 p, %0, %1;\n @p griddepcontrol.wait;\n @!p griddepcontrol.wait;\n}" :: "r"(a.x), "r"(magic) : "memory");
    out[threadIdx.x] = x[threadIdx.x] * __uint_as_float(a.x) + __uint_as_float(a.y);
}
extern "C" __global__ void vc(float* out, const unsigned short* w, const float* x) {
    uint4 a = ldg_stream(w + threadIdx.x * 8);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    out[threadIdx.x] = x[threadIdx.x] * __uint_as_float(a.x) + __uint_as_float(a.y);
}
