#!/usr/bin/env bash
# Thirtieth session, call a: what ab78128's binaries hold and no GPU has run yet. The device draw
# against its twin (cuda_backend cuda_draws_match_the_cpu_twin), the recorded steps with sampled
# draws (cuda_graph), cuda_dspark (the drafter's argmax on draw.cu's kernel, the engine's sampled
# requests speculating), the kernel bench's draw table, then decode at batches 1 / 16 / 64 on
# FLASH_LAYERS q2 layers, greedy and sampled (--step-sample).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> "$S"
run_test cuda_backend cuda_draws_match_the_cpu_twin --nocapture
grep -E 'draw_rows|rows drawn' "$OUT/test-cuda_backend.txt" >> "$S"
run_test cuda_graph
run_test cuda_dspark
timeout 240 .devbin/dsv4 bench --backend cuda --synthetic kernels > "$OUT/kernels.txt" 2>&1
echo "bench kernels: exit $?" >> "$S"
grep -E '^draw_rows' "$OUT/kernels.txt" >> "$S"
FL=${FLASH_LAYERS:-4}
for mode in ${MODES:-greedy sample}; do
  flag=""; [ $mode = sample ] && flag=--step-sample
  timeout 200 .devbin/dsv4 bench --backend cuda --synthetic flash --layers $FL --weights q2 --contexts '' \
    --reserve 64x4096 --decode-fill clone --decode-batches 1,16,64 --decode-context 4096 --decode-tokens 16 $flag \
    > "$OUT/bench-$mode.txt" 2>&1
  echo "bench $FL layers $mode: exit $?" >> "$S"
  grep -E '^decode' "$OUT/bench-$mode.txt" | cut -c1-200 >> "$S"
done
cat "$S"
