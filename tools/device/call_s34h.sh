#!/usr/bin/env bash
# call_s34g.sh cut for under 5 minutes of device time: the shared expert's value check, one pass
# of the batch-1 A/B (DSV4_SHARED_X8_ROWS 4 against 1), cuda_invariance, then batches 16 / 64.
#   run(command: "bash tools/device/call_s34h.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$G" >> "$S"
run_test cuda_packed cuda_int8_products_match_the_twin
FL=43; case "$G" in *H100*) FL=32 ;; esac
for cfg in "DSV4_SHARED_X8_ROWS=4" "DSV4_SHARED_X8_ROWS=1"; do
  env $cfg timeout 70 .devbin/dsv4 bench --backend cuda --synthetic flash --layers $FL --weights q2 --contexts '' \
      --reserve 1x4096 --decode-fill clone --decode-batches 1 --decode-context 4096 --decode-tokens 16 \
      --verify-drafts 1,2,3 --dspark-round > "$OUT/ab.txt" 2>&1
  echo "== $FL layers, $cfg: exit $?" >> "$S"
  grep -E '^(decode batch +1 at|verify|dspark batch +1(: draft|, measured))' "$OUT/ab.txt" \
    | sed -E 's/ = [0-9.]+x a decode.*//; s/ +[0-9.]+ ms\/layer.*//' | cut -c1-170 >> "$S"
done
run_test cuda_invariance
timeout 100 .devbin/dsv4 bench --backend cuda --synthetic flash --layers $FL --weights q2 --contexts '' \
    --reserve 64x4096 --decode-fill clone --decode-batches 16,64 --decode-context 4096 --decode-tokens 16 \
    > "$OUT/b1664.txt" 2>&1
echo "== $FL layers, batches 16 and 64: exit $?" >> "$S"
grep -E '^decode batch' "$OUT/b1664.txt" | cut -c1-150 >> "$S"
cat "$S"
