#!/usr/bin/env bash
# Thirty-second session, call c: after the code sums' revert (main = the slot records alone),
# decode steps at batches 16 then 64: built in (slot records), `noslots` (the kernels chasing
# active / off), `d5` (moe_downx_q2_k at 5 blocks an SM, on the slot records).
#   after build.sh: `bash tools/device/variants.sh 'd5=sed:quant.cu:s/X8_KERNELS(F_Q2_K, q2_k, 1, 4, 4)/X8_KERNELS(F_Q2_K, q2_k, 1, 5, 4)/'
#   noslots=revert:c842dbd:quant.cu`, then pack devbin.tar.xz:
#   run(command: "bash tools/device/call_s32c.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> "$S"
run_test cuda_packed cuda_packed_experts_match_cpu
for b in 16 64; do
  echo "== batch $b" >> "$S"
  BATCH=$b EXTRA="--reserve 64x4096 --decode-fill clone" bash tools/device/ab_step.sh .devbin/kvar/noslots .devbin/kvar/d5 2>&1 | cut -c1-80 >> "$S"
done
cat "$S"
