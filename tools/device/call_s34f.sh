#!/usr/bin/env bash
# The thirty-fourth session's one-call cut of call_s34a + call_s34b (device starts kept failing):
# the value checks of v42's changes and of gemvx2pq / gemvx4pq (wo_a's 2-4-row products with
# their outputs' codes), issue 11 at 43 q2 layers (32 on an H100) with everything on at batches
# 1 / 16 / 64, then batch 1 with DSV4_ROW_PAIRS=0 and with DSV4_FFN1_ROWS=1, cuda_dspark last.
#   run(command: "bash tools/device/call_s34f.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$G" >> "$S"
run_test cuda_backend cuda_block_attention_matches_the_cpu_twin --nocapture
grep -E '^block_attention' "$OUT/test-cuda_backend.txt" >> "$S"
run_test cuda_packed cuda_int8_products_match_the_twin cuda_one_row_experts_in_two_launches_are_bitwise \
    cuda_one_row_int8_products_in_one_launch_are_each_alone cuda_one_row_product_with_its_output_codes_is_bitwise
FL=43; case "$G" in *H100*) FL=32 ;; esac
for cfg in "DSV4_ROW_PAIRS=1" "DSV4_ROW_PAIRS=0" "DSV4_FFN1_ROWS=1"; do
  B=1 R=1x4096 T=100; [ "$cfg" = DSV4_ROW_PAIRS=1 ] && B=1,16,64 R=64x4096 T=200
  env $cfg timeout $T .devbin/dsv4 bench --backend cuda --synthetic flash --layers $FL --weights q2 --contexts '' \
      --reserve $R --decode-fill clone --decode-batches $B --decode-context 4096 --decode-tokens 16 \
      --verify-drafts 1,2,3,4 --dspark-round > "$OUT/issue11-${cfg#DSV4_}.txt" 2>&1
  echo "== flash q2 $FL layers, $cfg: exit $?" >> "$S"
  grep -E '^(decode batch|verify|dspark batch +[0-9]+(: draft|, measured))' "$OUT/issue11-${cfg#DSV4_}.txt" | cut -c1-200 >> "$S"
done
run_test cuda_dspark
cat "$S"
