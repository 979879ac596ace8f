#!/usr/bin/env bash
# Twenty-ninth session: sampling on the device (draw.cu). Its twin check
# (cuda_backend cuda_draws_match_the_cpu_twin), the recorded steps with sampled draws
# (cuda_graph), cuda_dspark unless DSPARK=0, then decode at batches 1 / 16 / 64 on FLASH_LAYERS
# q2 layers in each of MODES: greedy (ids), sample (ids drawn on the device, --step-sample),
# logits (every row's logits to the host, --step-logits: what a sampled row cost before).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
draw_twin_check
run_test cuda_graph
[ "${DSPARK:-1}" = 0 ] || run_test cuda_dspark
FL=${FLASH_LAYERS:-4}
for mode in ${MODES:-greedy sample logits}; do
  flag=""; [ $mode = sample ] && flag=--step-sample; [ $mode = logits ] && flag=--step-logits
  timeout 200 .devbin/dsv4 bench --backend cuda --synthetic flash --layers $FL --weights q2 --contexts '' \
    --reserve 64x4096 --decode-fill clone --decode-batches 1,16,64 --decode-context 4096 --decode-tokens 16 $flag \
    > "$OUT/bench-$mode.txt" 2>&1
  echo "bench $FL layers $mode: exit $?" >> "$S"
  grep -E '^decode' "$OUT/bench-$mode.txt" | cut -c1-200 >> "$S"
done
cat "$S"
