#!/usr/bin/env bash
# Thirtieth session, call b: the persistent bulk-copy gate/up kernel (moe_upp, DSV4_MOE_PIPE=1)
# bitwise against moe_upx, then its A/B on FLASH_LAYERS q2 layers at batches 16 and 64 (two
# passes each: batch 64 also each kernel alone, and kvar/simple: the producer of 9912adf); then, unless CHECKS=0, call a's checks (the device draw's twin, cuda_graph, cuda_dspark) and the
# kernel bench's draw table.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> "$S"
run_test cuda_packed cuda_experts_on_the_pipelined_kernel_are_bitwise --nocapture
grep -E '^moe_upp' "$OUT/test-cuda_packed.txt" | tail -3 >> "$S"
FL=${FLASH_LAYERS:-4}
LAYERS=$FL BATCH=64 EXTRA="--reserve 64x4096 --decode-fill clone" bash tools/device/ab_step.sh DSV4_MOE_PIPE=1 \
  DSV4_MOE_PIPE=up DSV4_MOE_PIPE=down DSV4_MOE_PIPE=1+DSV4_CUDA_KERNELS=$PWD/.devbin/kvar/simple >> "$S" 2>&1
LAYERS=$FL BATCH=16 EXTRA="--reserve 64x4096 --decode-fill clone" bash tools/device/ab_step.sh DSV4_MOE_PIPE=1 >> "$S" 2>&1
if [ "${CHECKS:-1}" = 1 ]; then
  run_test cuda_backend cuda_draws_match_the_cpu_twin --nocapture
  grep -E 'draw_rows|rows drawn' "$OUT/test-cuda_backend.txt" >> "$S"
  run_test cuda_graph
  run_test cuda_dspark
  DSV4_MOE_PIPE=1 run_test cuda_invariance
  timeout 240 .devbin/dsv4 bench --backend cuda --synthetic kernels > "$OUT/kernels.txt" 2>&1
  echo "bench kernels: exit $?" >> "$S"
  grep -E '^draw_rows' "$OUT/kernels.txt" >> "$S"
fi
cat "$S"
