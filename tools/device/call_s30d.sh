#!/usr/bin/env bash
# Thirtieth session, call d: draw.cu with 8 loads in flight a thread in its passes and the warp walk (as
# of the commit after 789f28f, the kernel directory kvar/each over 70e2680's binaries): the twin check, the draw table, then
# one pass of sampled decode at batch 1 against 70e2680's draw.cu (built in).
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
