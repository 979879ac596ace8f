#!/usr/bin/env bash
# call_s34a.sh and call_s34b.sh cut for a device budget under 5 minutes: the kernel checks of
# v42's changes (block attention, the 2-4-row int8 products alone and grouped, the experts of several rows in two
# launches), then batch 1's A/B at 43 layers (H100: 32): all on, DSV4_ROW_PAIRS=0,
# DSV4_FFN1_ROWS=1; cuda_dspark last.
#   run(command: "bash tools/device/call_s34e.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$G" >> "$S"
run_test cuda_backend cuda_block_attention_matches_the_cpu_twin --nocapture
grep -E '^block_attention' "$OUT/test-cuda_backend.txt" >> "$S"
run_test cuda_packed cuda_int8_products_match_the_twin cuda_one_row_experts_in_two_launches_are_bitwise \
    cuda_one_row_int8_products_in_one_launch_are_each_alone
FL=43; case "$G" in *H100*) FL=32 ;; esac
for cfg in "DSV4_ROW_PAIRS=1" "DSV4_ROW_PAIRS=0" "DSV4_FFN1_ROWS=1"; do
  env $cfg timeout 100 .devbin/dsv4 bench --backend cuda --synthetic flash --layers $FL --weights q2 --contexts '' \
      --reserve 1x4096 --decode-fill clone --decode-batches 1 --decode-context 4096 --decode-tokens 16 \
      --verify-drafts 1,2,3,4 --dspark-round > "$OUT/issue11-${cfg#DSV4_}.txt" 2>&1
  echo "== flash q2 $FL layers, $cfg: exit $?" >> "$S"
  grep -E '^(decode batch|verify|dspark batch +[0-9]+(: draft|, measured))' "$OUT/issue11-${cfg#DSV4_}.txt" | cut -c1-200 >> "$S"
done
run_test cuda_dspark
cat "$S"
