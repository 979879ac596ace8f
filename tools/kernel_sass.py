#!/usr/bin/env python3
"""Offline instruction counts of a CUDA kernel's hot loop (no GPU needed).

Compiles one of `crates/dsv4-backend/src/cuda/kernels/*.cu` the way the backend does (NVRTC,
compute_90a, the file's fmad setting, `common.cuh` prepended; quant.cu gets zeroed IQ2_XXS
tables and gemm.cu appended, which do not change the code), assembles it for sm_90a with ptxas, disassembles it,
and reports for each named kernel its longest loop: instructions, a weighted issue cost and the
most frequent opcodes. The weights are cycles a warp instruction occupies one SM sub-partition
on Hopper: FP32 1, integer/logic/PRMT 2, conversions and MUFU 8. A static predictor only:
time the kernels with `dsv4 bench --backend cuda --synthetic kernels` (the device compiles
with its own NVRTC, CUDA 13.0, whose code may differ a little).

Needs NVRTC, ptxas, cuobjdump and nvdisasm; pinned wheels from PyPI hold them:
  pip download --no-deps -d /tmp/cuda-tools nvidia-cuda-nvrtc==13.5.37 nvidia-cuda-nvcc==13.5.37 \
      nvidia-cuda-cuobjdump==13.5.37 nvidia-cuda-nvdisasm==13.5.37
  (cd /tmp/cuda-tools && for f in *.whl; do unzip -qo "$f"; done)
  python3 tools/kernel_sass.py --cuda /tmp/cuda-tools/nvidia/cu13 quant.cu gemv1_iq2_xxs gemv1_q8_0

`--against REV` also compiles the file as of git revision REV and prints both; `--fmad true|false`
forces FMA contraction on or off (the file's setting by default); SASS_TOP sets how
many opcodes the summary names, SASS_DUMP=1 prints the loop itself to stderr, SASS_FULL=1 the
whole kernel. FILE may also be
a path with a '/' (relative to the repository), e.g. tools/sass/iq2_sign_variants.cu.
"""
import argparse
import collections
import ctypes
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
KDIR = "crates/dsv4-backend/src/cuda/kernels"
# The files the backend compiles with contraction on (cuda/mod.rs, `ptx`).
FMAD = {"bf16.cu", "quant.cu"}
INT_OPS = {"IADD3", "LOP3", "SHF", "IMAD", "PRMT", "ISETP", "SEL", "LEA", "IABS", "BMSK", "SGXT", "IMNMX", "POPC",
           "FLO", "BREV", "VIADD"}
SLOW = {"I2F", "F2I", "F2F", "MUFU"}
# `--fmad true|false`: compile with that contraction setting instead of the file's (whether a
# device function would compute the same values in a file compiled the other way).
FMAD_OVERRIDE = None


def source(name, rev):
    def read(path):
        if rev is None:
            with open(os.path.join(ROOT, path)) as f:
                return f.read()
        return subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{path}"], check=True, capture_output=True,
                              text=True).stdout
    src = read(f"{KDIR}/common.cuh") + "\n"
    if name == "quant.cu":
        src += ("__device__ const unsigned long long IQ2XXS_GRID[256] = {0};\n"
                "__device__ const unsigned char KSIGNS_IQ2XS[128] = {0};\n"
                "__device__ const unsigned long long KMASK_IQ2XS[128] = {0};\n"
                "__device__ const unsigned long long IQ2XXS_SEL[256] = {0};\n")
    if "/" in name:  # a file outside the backend's kernels (tools/sass/: decode experiments)
        return src + read(name)
    if name == "quant.cu":  # one module with gemm.cu, as cuda/quant.rs builds it
        return src + read(f"{KDIR}/quant.cu") + "\n" + read(f"{KDIR}/gemm.cu")
    return src + read(f"{KDIR}/{name}")


def ptx(nvrtc, src, name):
    prog = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None) != 0:
        sys.exit("nvrtcCreateProgram failed")
    fmad = name in FMAD if FMAD_OVERRIDE is None else FMAD_OVERRIDE
    opts = [b"--gpu-architecture=compute_90a", b"--std=c++17", b"--fmad=true" if fmad else b"--fmad=false"]
    r = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    if r != 0:
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        sys.exit(log.value.decode())
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    nvrtc.nvrtcGetPTX(prog, buf)
    return buf.value.decode()


def cost(op):
    base = op.split(".")[0]
    return 8 if base in SLOW else 2 if base in INT_OPS else 1


def hot_loop(sass):
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(3), m.group(4)))
    loops = []
    for a, op, args in ins:
        t = re.search(r"0x([0-9a-f]+)", args) if op.startswith("BRA") else None
        if t and int(t.group(1), 16) < a:
            loops.append((int(t.group(1), 16), a))
    if not loops:
        return None
    lo, hi = max(loops, key=lambda x: x[1] - x[0])
    if os.environ.get("SASS_DUMP"):  # the loop's instructions themselves, to stderr
        for a, op, args in ins:
            if lo <= a <= hi:
                print(f"{a:6x}  {op} {args}", file=sys.stderr)
    return [op for a, op, _ in ins if lo <= a <= hi]


def report(tools, nvrtc, name, kernels, rev, usage=False, defines=()):
    with tempfile.TemporaryDirectory() as d:
        p, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        pre = "".join(f"#define {k} {v if eq else 1}\n" for k, eq, v in (x.partition("=") for x in defines))
        with open(p, "w") as f:
            f.write(ptx(nvrtc, pre + source(name, rev), os.path.basename(name)))
        r = subprocess.run([os.path.join(tools, "bin", "ptxas"), "-arch=sm_90a", "-O3", "-v", p, "-o", cubin],
                           check=True, capture_output=True, text=True)
        if usage:
            # ptxas -v: "Compiling entry function 'K'" then its registers, spills and shared memory.
            lines, cur = r.stderr.splitlines(), None
            for ln in lines:
                m = re.search(r"Compiling entry function '(\w+)'", ln)
                if m:
                    cur = m.group(1)
                elif cur in kernels and ("registers" in ln or "spill" in ln):
                    print(f"{rev or 'worktree':>10} {cur}: {ln.split(':', 1)[-1].strip()}")
                    # Static shared memory past 48 KB fails at module load (ptxas 12.9 says so;
                    # 13.5 only reports the size): the module would not load on the device.
                    m = re.search(r"(\d+) bytes smem", ln)
                    if m and int(m.group(1)) > 48 * 1024:
                        print(f"{rev or 'worktree':>10} {cur}: ERROR {m.group(1)} bytes of static shared memory "
                              "(more than 48 KB: the module fails to load)")
                elif cur in kernels and "warning" in ln:  # e.g. wgmma serialized
                    print(f"{rev or 'worktree':>10} {cur}: {ln.strip()}")
        env = dict(os.environ, PATH=os.path.join(tools, "bin") + os.pathsep + os.environ.get("PATH", ""))
        for k in kernels:
            sass = subprocess.run([os.path.join(tools, "bin", "cuobjdump"), "-sass", "-fun", k, cubin], env=env,
                                  check=True, capture_output=True, text=True).stdout
            if os.environ.get("SASS_FULL"):
                sys.stderr.write(sass)
            body = hot_loop(sass)
            tag = rev or "worktree"
            if body is None:
                print(f"{tag:>10} {k}: no loop")
                continue
            top = collections.Counter(op.split(".")[0] for op in body).most_common(int(os.environ.get("SASS_TOP", "8")))
            print(f"{tag:>10} {k}: loop {len(body)} instructions, weighted {sum(map(cost, body))}; "
                  + ", ".join(f"{o} {n}" for o, n in top))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuda", required=True, help="folder holding lib/libnvrtc.so* and bin/{ptxas,cuobjdump,nvdisasm}")
    ap.add_argument("--against", help="a git revision to compare with")
    ap.add_argument("file")
    ap.add_argument("kernels", nargs="+")
    ap.add_argument("--usage", action="store_true", help="also print ptxas's registers, spills and shared memory")
    ap.add_argument("-D", dest="defines", action="append", default=[],
                    help="NAME=VALUE prepended as a #define (the launcher's macros, e.g. X8_PIPE=4)")
    ap.add_argument("--fmad", choices=["file", "true", "false"], default="file",
                    help="FMA contraction: the file's setting (the backend's), or forced on or off")
    a = ap.parse_args()
    global FMAD_OVERRIDE
    FMAD_OVERRIDE = None if a.fmad == "file" else a.fmad == "true"
    lib = os.path.join(a.cuda, "lib")
    so = next(f for f in sorted(os.listdir(lib)) if f.startswith("libnvrtc.so"))
    nvrtc = ctypes.CDLL(os.path.join(lib, so))
    if a.against:
        report(a.cuda, nvrtc, a.file, a.kernels, a.against, a.usage, a.defines)
    report(a.cuda, nvrtc, a.file, a.kernels, None, a.usage, a.defines)


if __name__ == "__main__":
    main()
