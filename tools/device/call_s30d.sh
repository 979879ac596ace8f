#!/usr/bin/env bash
# Thirtieth session, call d (not run: the session's device time ran out): draw.cu with 8 loads
# in flight a thread in its passes and the unfiltered draw walked by a warp
# (tools/device/patches/v39-draw-loads.diff, as the kernel directory kvar/each: after build.sh,
# `bash tools/device/variants.sh each=patch:tools/device/patches/v39-draw-loads.diff`): the twin
# check, the draw table, then one pass of sampled decode at batch 1 against main's draw.cu.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> "$S"
K=$PWD/.devbin/kvar/each
DSV4_CUDA_KERNELS=$K run_test cuda_backend cuda_draws_match_the_cpu_twin --nocapture
grep -E 'rows drawn' "$OUT/test-cuda_backend.txt" >> "$S"
DSV4_CUDA_KERNELS=$K timeout 120 .devbin/dsv4 bench --backend cuda --synthetic kernels > "$OUT/kernels.txt" 2>&1
echo "bench kernels (each): exit $?" >> "$S"
grep -E '^draw_rows' "$OUT/kernels.txt" >> "$S"
for v in builtin each; do
  e=(); [ $v = each ] && e=(env DSV4_CUDA_KERNELS=$K)
  r=$("${e[@]}" timeout 60 .devbin/dsv4 bench --backend cuda --synthetic flash --layers 4 --weights q2 --contexts '' \
      --decode-batches 1 --decode-context 4096 --decode-tokens 64 --step-sample 2>&1 | grep -E '^decode batch' | head -1 | cut -c1-90)
  echo "$v: $r" >> "$S"
done
cat "$S"
