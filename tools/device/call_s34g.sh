#!/usr/bin/env bash
# Thirty-fourth session, second build: the shared expert of 2-4 rows on the routed-expert row-group
# kernels (DSV4_SHARED_X8_ROWS, default 4; 1 = one row only, as before), the two launches for one
# row only (DSV4_FFN1_ROWS default 1), gemvx2pq / gemvx4pq. Value checks, then batch 1's decode,
# verify and DSpark rounds at 43 q2 layers (32 on an H100) with the shared rows at 4 and 1, two
# passes, then issue 11's batches 16 and 64.
#   run(command: "bash tools/device/call_s34g.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$G" >> "$S"
run_test cuda_packed cuda_int8_products_match_the_twin cuda_one_row_experts_in_two_launches_are_bitwise \
    cuda_one_row_product_with_its_output_codes_is_bitwise
run_test cuda_invariance
run_test cuda_dspark
FL=43; case "$G" in *H100*) FL=32 ;; esac
for p in 1 2; do
  for cfg in "DSV4_SHARED_X8_ROWS=4" "DSV4_SHARED_X8_ROWS=1"; do
    env $cfg timeout 70 .devbin/dsv4 bench --backend cuda --synthetic flash --layers $FL --weights q2 --contexts '' \
        --reserve 1x4096 --decode-fill clone --decode-batches 1 --decode-context 4096 --decode-tokens 16 \
        --verify-drafts 1,2,3,4 --dspark-round > "$OUT/ab.txt" 2>&1
    echo "== pass $p, $FL layers, $cfg: exit $?" >> "$S"
    grep -E '^(decode batch +1 at|verify|dspark batch +1(: draft|, measured))' "$OUT/ab.txt" \
      | sed -E 's/ = [0-9.]+x a decode.*//; s/ +[0-9.]+ tok\/s +[0-9.]+ ms\/layer.*//' | cut -c1-170 >> "$S"
  done
done
timeout 150 .devbin/dsv4 bench --backend cuda --synthetic flash --layers $FL --weights q2 --contexts '' \
    --reserve 64x4096 --decode-fill clone --decode-batches 16,64 --decode-context 4096 --decode-tokens 16 \
    > "$OUT/b1664.txt" 2>&1
echo "== $FL layers, batches 16 and 64: exit $?" >> "$S"
grep -E '^decode batch' "$OUT/b1664.txt" | cut -c1-150 >> "$S"
cat "$S"
