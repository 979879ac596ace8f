#!/usr/bin/env bash
# Here, after build.sh (and variants.sh): the PTX of the built-in kernels and of every
# .devbin/kvar/* variant, compiled by NVRTC 13.0 (the device's CUDA 13.0; the kernel cache's key
# holds NVRTC's major.minor) into .devbin/ptx, which run_test.sh hands the device's processes as
# DSV4_KERNEL_CACHE. Each device process then loads PTX where it compiled for ~35 s (~70 s a
# quant.cu variant). NVRTC 13.0 comes from pip's nvidia-cuda-nvrtc wheel (NVRTC130 to override).
#   bash tools/device/keep_ptx.sh [VARIANT...]   (default: every .devbin/kvar/*)
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
        env -u DSV4_X8_OPW -u DSV4_X8_PIPE DSV4_CUDA_KERNELS=.devbin/kvar/$v .devbin/dsv4 compile-kernels &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || fail=1; done
    i=$((i + n))
done
ls .devbin/ptx | sed 's/-.*//' | sort | uniq -c
du -sh .devbin/ptx
exit $fail
