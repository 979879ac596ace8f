#!/usr/bin/env bash
# Here, after build.sh (and variants.sh): the PTX of the built-in kernels and of every
# .devbin/kvar/* variant, compiled by NVRTC 13.0 (the device's CUDA 13.0; the kernel cache's key
# holds NVRTC's major.minor) into .devbin/ptx, which run_test.sh hands the device's processes as
# DSV4_KERNEL_CACHE. Each device process then loads PTX where it compiled for ~35 s (~70 s a
# quant.cu variant), and loads the cubin assembled beside each PTX (no driver compile either).
# NVRTC and ptxas 13.0 come from pip's nvidia-cuda-nvrtc / nvidia-cuda-nvcc wheels (NVRTC130
# names their folder).
#   bash tools/device/keep_ptx.sh [VARIANT...]   (default: every .devbin/kvar/*)
# A VARIANT is a .devbin/kvar directory's name, or environment settings of the launcher that
# change the kernels' source (e.g. 'DSV4_X8_OPW=1,4,2' or 'DSV4_X8_OPW=1,2,1 DSV4_X8_PIPE=2').
set -euo pipefail
cd "$(dirname "$0")/../.."
N=${NVRTC130:-/tmp/nvrtc130}
if [ ! -e "$N/nvidia/cu13/lib/libnvrtc.so.13" ]; then
    mkdir -p "$N" && (cd "$N" && python3 -m pip download -q --no-deps -d . 'nvidia-cuda-nvrtc>=13.0,<13.1' \
        && for f in *.whl; do python3 -m zipfile -e "$f" .; done)
fi
export LD_LIBRARY_PATH="$N/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" DSV4_KERNEL_CACHE=$PWD/.devbin/ptx
# The built-in kernels: none of the launcher's variant settings from the caller's environment.
env -u DSV4_CUDA_KERNELS -u DSV4_X8_OPW -u DSV4_X8_PIPE .devbin/dsv4 compile-kernels
vs=("$@"); [ ${#vs[@]} -gt 0 ] || vs=($(ls .devbin/kvar 2>/dev/null || true))
# The variants, nproc at a time (each waited for by its pid, so every failure counts).
fail=0 n=$(nproc) i=0
while [ $i -lt ${#vs[@]} ]; do
    pids=()
    for v in "${vs[@]:i:n}"; do
        if [[ $v == *=* ]]; then
            # shellcheck disable=SC2086  # the settings split into words on purpose
            env -u DSV4_CUDA_KERNELS -u DSV4_X8_OPW -u DSV4_X8_PIPE $v .devbin/dsv4 compile-kernels &
        else
            env -u DSV4_X8_OPW -u DSV4_X8_PIPE DSV4_CUDA_KERNELS=.devbin/kvar/$v .devbin/dsv4 compile-kernels &
        fi
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || fail=1; done
    i=$((i + n))
done
# Each kept PTX assembled for sm_90a by the same CUDA version's ptxas (the backend loads the
# cubin beside a PTX where the device takes it: no driver compile at each process start).
P=$N/nvidia/cu13/bin/ptxas
if [ ! -x "$P" ]; then
    (cd "$N" && python3 -m pip download -q --no-deps -d . 'nvidia-cuda-nvcc>=13.0,<13.1' \
        && for f in nvidia_cuda_nvcc*.whl; do python3 -m zipfile -e "$f" .; done) && chmod +x "$N"/nvidia/cu13/bin/*
fi
todo=()
for f in .devbin/ptx/*.ptx; do [ -e "${f%.ptx}.sm_90a.cubin" ] || todo+=("$f"); done
i=0
while [ $i -lt ${#todo[@]} ]; do
    pids=()
    # Written under a temporary name and renamed when whole: an interrupted ptxas leaves no
    # cut-off cubin for the next run to skip and pack.
    for f in "${todo[@]:i:n}"; do
        c=${f%.ptx}.sm_90a.cubin
        ( "$P" -arch=sm_90a -o "$c.tmp" "$f" && mv "$c.tmp" "$c" || { rm -f "$c.tmp"; exit 1; } ) & pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || fail=1; done
    i=$((i + n))
done
ls .devbin/ptx | sed 's/-.*\././' | sort | uniq -c
du -sh .devbin/ptx
exit $fail
