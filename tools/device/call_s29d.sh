#!/usr/bin/env bash
# Twenty-ninth session: draw.cu's selects on value bins with the bin's tokens gathered (by value,
# without exp). Twin check and launch times, cuda_graph, then decode sampled on the device.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> "$S"
run_test cuda_backend cuda_draws_match_the_cpu_twin --nocapture
grep -E 'draw_rows|rows drawn' "$OUT/test-cuda_backend.txt" >> "$S"
run_test cuda_graph
FL=${FLASH_LAYERS:-4}
for mode in --step-sample ""; do
  timeout 200 .devbin/dsv4 bench --backend cuda --synthetic flash --layers $FL --weights q2 --contexts '' \
    --reserve 64x4096 --decode-fill clone --decode-batches 1,16,64 --decode-context 4096 --decode-tokens 16 $mode \
    > "$OUT/bench$mode.txt" 2>&1
  echo "bench $FL layers ${mode:-greedy}: exit $?" >> "$S"
  grep -E '^decode batch .*ms/step' "$OUT/bench$mode.txt" | cut -c1-80 >> "$S"
done
cat "$S"
