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
.devbin/dsv4 compile-kernels
vs=("$@"); [ ${#vs[@]} -gt 0 ] || vs=($(ls .devbin/kvar 2>/dev/null))
for v in "${vs[@]}"; do
    DSV4_CUDA_KERNELS=.devbin/kvar/$v .devbin/dsv4 compile-kernels 2>&1 | grep -v 'instead of the built-in' &
    [ $(jobs -r | wc -l) -lt "$(nproc)" ] || wait -n
done
wait
ls .devbin/ptx | sed 's/-.*//' | sort | uniq -c
du -sh .devbin/ptx
