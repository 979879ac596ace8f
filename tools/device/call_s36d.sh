#!/usr/bin/env bash
# call_s36c cut to what ~4 minutes hold (PERF.md v45): batch-1 decode steps with the side
# branch off and on (both on kvar/ptab0, the current quant.cu), then its bitwise test, then
# X8_PTAB at batch 1 while the call has time (LIMIT, default 200 s).
#   run(command: "bash tools/device/call_s36d.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
call_start 200
step1 side0 DSV4_CUDA_KERNELS=.devbin/kvar/ptab0
step1 side1 DSV4_SIDE=1 DSV4_CUDA_KERNELS=.devbin/kvar/ptab0
t && step1 side0b DSV4_CUDA_KERNELS=.devbin/kvar/ptab0
t && step1 side1b DSV4_SIDE=1 DSV4_CUDA_KERNELS=.devbin/kvar/ptab0
t && { export DSV4_BIN=.devbin/dsv4; run_test cuda_gguf cuda_gguf_side_branch_is_bitwise --nocapture; grep -E '^exact' "$OUT/test-cuda_gguf.txt" >> "$S"; }
t && step1 side1ptab DSV4_SIDE=1 DSV4_CUDA_KERNELS=.devbin/kvar/ptab
echo "total $(( $(date +%s) - T0 )) s" >> "$S"
cat "$S"
