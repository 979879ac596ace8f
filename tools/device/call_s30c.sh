#!/usr/bin/env bash
# Thirtieth session, call c: the f32 device draw (70e2680) against its twin
# (cuda_backend cuda_draws_match_the_cpu_twin), cuda_dspark (the drafter's argmax on draw.cu's
# kernel, the engine's sampled requests speculating: not yet run on a GPU), cuda_graph (sampled
# recorded steps against the twin); then sampled decode steps (--step-sample: T 0.7, top-p 0.95
# every row) with the built-in draw.cu against b585ab7's (kernel directory olddraw) at batch 1
# and 64, and the kernel bench's draw table.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
draw_twin_check
run_test cuda_dspark
run_test cuda_graph
for b in 1 64; do
  LAYERS=4 BATCH=$b EXTRA="--reserve 64x4096 --decode-fill clone --step-sample" \
    bash tools/device/ab_step.sh .devbin/kvar/olddraw >> "$S" 2>&1
done
timeout 240 .devbin/dsv4 bench --backend cuda --synthetic kernels > "$OUT/kernels.txt" 2>&1
echo "bench kernels: exit $?" >> "$S"
grep -E '^draw_rows' "$OUT/kernels.txt" >> "$S"
cat "$S"
