#!/usr/bin/env bash
# Thirty-first session, call c: on 8f09b56's binaries, kernel directories over ec29f65's quant.cu
# (b4: the several-row expert kernels at 4 blocks an SM): v1 (IQ2_XXS / Q8_0 chunks summed in
# two dp4a chains of four, not one of eight), u2 (v1, four-row groups 2 chunks ahead), u2all
# (u2, eight-row groups 2 ahead and two-row groups 4). Quick value checks of each, the int8
# twin of u2all, then decode steps at batches 1, 16 and 64.
#   run(command: "bash tools/device/call_s31c.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> "$S"
for v in v1 u2 u2all; do
  export DSV4_CUDA_KERNELS=$PWD/.devbin/kvar/$v
  echo "== $v" >> "$S"
  run_test cuda_packed cuda_packed_experts_match_cpu
  run_test cuda_invariance cuda_invariance_at_16_rows_fast
  [ $v = u2all ] && run_test cuda_packed cuda_int8_products_match_the_twin
  unset DSV4_CUDA_KERNELS
done
for b in 64 16 1; do
  echo "== batch $b" >> "$S"
  BATCH=$b EXTRA="--reserve 64x4096 --decode-fill clone" bash tools/device/ab_step.sh .devbin/kvar/b4 .devbin/kvar/v1 \
    .devbin/kvar/u2 .devbin/kvar/u2all 2>&1 | cut -c1-75 >> "$S"
done
cat "$S"
