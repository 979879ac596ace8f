#!/usr/bin/env bash
# Thirty-first session, call b: the several-row int8 kernels without local memory (PERF.md v40:
# rows kept as 32-bit offsets, gate/up stored together, every raw word written each iteration),
# as kernel directories on 8f09b56's binaries: `new` (the working tree's quant.cu) and `b4`
# (new, with moe_upx_iq2_xxs and moe_downx_q2_k built for 4 blocks an SM). Their twin and
# invariance tests, then decode steps at batches 16 and 64 against the built-in kernels, then
# ncu's stall table of new at batch 64.
#   run(command: "bash tools/device/call_s31b.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> "$S"
for v in new b4; do
  export DSV4_CUDA_KERNELS=$PWD/.devbin/kvar/$v
  echo "== $v" >> "$S"
  run_test cuda_packed cuda_int8_products_match_the_twin
  run_test cuda_packed cuda_packed_experts_match_cpu
  run_test cuda_invariance cuda_invariance_at_16_rows_fast
  run_test cuda_graph
  unset DSV4_CUDA_KERNELS
done
for b in 16 64; do
  echo "== batch $b" >> "$S"
  BATCH=$b EXTRA="--reserve 64x4096 --decode-fill clone" bash tools/device/ab_step.sh .devbin/kvar/new .devbin/kvar/b4 >> "$S" 2>&1
done
echo "== ncu (new)" >> "$S"
DSV4_CUDA_KERNELS=$PWD/.devbin/kvar/new EXTRA="--reserve 64x4096 --decode-fill clone" BATCH=64 TAG=-new \
  timeout 200 bash tools/device/ncu_stalls.sh 'moe_upx_iq2_xxs|moe_downx_q2_k' 4 2 >> "$S" 2>&1
cat "$S"
