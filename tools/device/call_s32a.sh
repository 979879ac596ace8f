#!/usr/bin/env bash
# Prepared in the thirty-first session for the next: the first GPU run of 22dcdfd's quant.cu
# (PERF.md v40: two dp4a chains only in the several-row groups, `u2s`) and of 0279e2a's draw.cu
# as built-in kernels, against the measured `u2` (two chains in every int8 form) as a kernel
# directory, and `r8u2` (the up kernels' eight-row groups 2 chunks ahead: no spills offline).
# Value checks, then decode steps at batches 1, 16 and 64, then ncu's source counters of the
# sampled draw (T 0.7, top-p 0.95) in a batch-1 step (PERF.md "Next (after v40)" item 4).
#   after build.sh: `bash tools/device/variants.sh u2=sed:quant.cu:'s/bool SPLIT = false>/bool SPLIT = true>/'
#   'r8u2=sed:quant.cu:s/xrows_group<F, 8, NW, 1>/xrows_group<F, 8, NW, NW == 2 ? 2 : 1>/'`
#   (u2: the split in every form, as measured in call c), then pack devbin.tar.xz:
#   run(command: "bash tools/device/call_s32a.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
draw_twin_check
run_test cuda_packed
run_test cuda_invariance
run_test cuda_graph
run_test cuda_dspark
echo "== r8u2" >> "$S"
DSV4_CUDA_KERNELS=$PWD/.devbin/kvar/r8u2 run_test cuda_packed cuda_int8_products_match_the_twin
DSV4_CUDA_KERNELS=$PWD/.devbin/kvar/r8u2 run_test cuda_packed cuda_packed_experts_match_cpu
for b in 1 64 16; do
  echo "== batch $b" >> "$S"
  BATCH=$b EXTRA="--reserve 64x4096 --decode-fill clone" bash tools/device/ab_step.sh .devbin/kvar/u2 .devbin/kvar/r8u2 2>&1 | cut -c1-80 >> "$S"
done
echo "== draw_rows (ncu source, batch 1, --step-sample)" >> "$S"
BATCH=1 EXTRA=--step-sample TAG=-draw timeout 200 bash tools/device/ncu_source.sh draw_rows 4 1 2>&1 | head -45 >> "$S"
cat "$S"
