#!/usr/bin/env bash
# Prepared in the thirty-third session, after call_s34a.sh on the same binaries: issue 11's
# figures at FLASH_LAYERS q2 layers (43 on an H200, 32 on an H100) with v42's three changes on
# (the new block attention, gemvx2p / gemvx4p, the experts of 2-4 rows in two launches), then
# batch 1's decode, verify and DSpark rounds with the pairs off (DSV4_ROW_PAIRS=0) and with the
# two launches for one row only (DSV4_FFN1_ROWS=1): the A/B of the 2- to 4-row changes.
#   run(command: "bash tools/device/call_s34b.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$G" >> "$S"
FL=43; case "$G" in *H100*) FL=32 ;; esac
FL=${FLASH_LAYERS:-$FL}
for cfg in "DSV4_ROW_PAIRS=1" "DSV4_ROW_PAIRS=0" "DSV4_FFN1_ROWS=1"; do
  B=1; [ "$cfg" = DSV4_ROW_PAIRS=1 ] && B=1,16,64
  env $cfg timeout 180 .devbin/dsv4 bench --backend cuda --synthetic flash --layers $FL --weights q2 --contexts '' \
      --reserve 64x4096 --decode-fill clone --decode-batches $B --decode-context 4096 --decode-tokens 16 \
      --verify-drafts 1,2,3,4 --dspark-round > "$OUT/issue11-${cfg#DSV4_}.txt" 2>&1
  echo "== flash q2 $FL layers, $cfg: exit $?" >> "$S"
  grep -E '^(decode batch|verify|dspark batch +[0-9]+(: draft|, measured))' "$OUT/issue11-${cfg#DSV4_}.txt" | cut -c1-200 >> "$S"
done
cat "$S"
