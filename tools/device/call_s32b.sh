#!/usr/bin/env bash
# Thirty-second session, call b: the first GPU run of c842dbd (PERF.md v41): the several-row
# Q2_K down kernels reading h's 16-value code sums (quant_x8s) and the several-row expert
# kernels reading moe_sort's slot records, built in, against `noxs` (the kernels forming the
# sums in every warp as before), `noslots` (the kernels chasing active / off as before) and `d5`
# (moe_downx_q2_k at 5 blocks an SM: 48 registers, spills in the 8-row group). Value checks,
# then decode steps at batches 64 and 16, then ncu's stall table of the expert kernels at 64.
#   after build.sh: `bash tools/device/variants.sh 'noxs=sed:quant.cu:s/xrows_all<F, P, GM, F == F_Q2_K>/xrows_all<F, P, GM, false>/'
#   'd5=sed:quant.cu:s/X8_KERNELS(F_Q2_K, q2_k, 1, 4, 4)/X8_KERNELS(F_Q2_K, q2_k, 1, 5, 4)/'
#   noslots=revert:c842dbd:quant.cu`, then pack devbin.tar.xz:
#   run(command: "bash tools/device/call_s32b.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> "$S"
run_test cuda_packed
run_test cuda_invariance
run_test cuda_graph
echo "== d5" >> "$S"
DSV4_CUDA_KERNELS=$PWD/.devbin/kvar/d5 run_test cuda_packed cuda_packed_experts_match_cpu
for b in 64 16; do
  echo "== batch $b" >> "$S"
  BATCH=$b EXTRA="--reserve 64x4096 --decode-fill clone" bash tools/device/ab_step.sh .devbin/kvar/noxs .devbin/kvar/noslots .devbin/kvar/d5 2>&1 | cut -c1-80 >> "$S"
done
echo "== ncu batch 64" >> "$S"
EXTRA="--reserve 64x4096 --decode-fill clone" BATCH=64 timeout 120 bash tools/device/ncu_stalls.sh 'moe_upx_iq2_xxs|moe_downx_q2_k|quant_x8s' 4 3 >> "$S" 2>&1
cat "$S"
