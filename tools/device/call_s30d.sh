#!/usr/bin/env bash
# Thirtieth session, call d: draw.cu with 8 loads in flight a thread in its passes (kernel
# directory kvar/each over 70e2680's binaries): the twin check, sampled decode at batch 1
# against 70e2680's draw.cu (built in) and b585ab7's (olddraw), and the draw table.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> "$S"
K=$PWD/.devbin/kvar/each
DSV4_CUDA_KERNELS=$K run_test cuda_backend cuda_draws_match_the_cpu_twin --nocapture
grep -E 'rows drawn' "$OUT/test-cuda_backend.txt" >> "$S"
LAYERS=4 BATCH=1 EXTRA="--step-sample" bash tools/device/ab_step.sh .devbin/kvar/each .devbin/kvar/olddraw >> "$S" 2>&1
DSV4_CUDA_KERNELS=$K timeout 240 .devbin/dsv4 bench --backend cuda --synthetic kernels > "$OUT/kernels.txt" 2>&1
echo "bench kernels (each): exit $?" >> "$S"
grep -E '^draw_rows' "$OUT/kernels.txt" >> "$S"
cat "$S"
