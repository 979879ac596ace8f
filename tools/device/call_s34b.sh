#!/usr/bin/env bash
# Prepared in the thirty-third session, after call_s34a.sh on the same binaries: issue 11's
# figures at FLASH_LAYERS q2 layers (43 on an H200; pass FLASH_LAYERS=32 on an H100) with the
# new block attention and gemvx2p / gemvx4p (DSV4_ROW_PAIRS on, the default), then batch 1's
# decode, verify and DSpark rounds with the pairs off: the A/B of the 2- to 4-row products.
#   run(command: "bash tools/device/call_s34b.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> "$S"
FL=${FLASH_LAYERS:-43}
for p in 1 0; do
  B=1,16,64; [ $p = 0 ] && B=1
  DSV4_ROW_PAIRS=$p timeout 250 .devbin/dsv4 bench --backend cuda --synthetic flash --layers $FL --weights q2 --contexts '' \
      --reserve 64x4096 --decode-fill clone --decode-batches $B --decode-context 4096 --decode-tokens 16 \
      --verify-drafts 1,2,3,4 --dspark-round > "$OUT/issue11-pairs$p.txt" 2>&1
  echo "== flash q2 $FL layers, DSV4_ROW_PAIRS=$p: exit $?" >> "$S"
  grep -E '^(decode|verify|dspark batch +[0-9]+(: draft|, verify|, measured))' "$OUT/issue11-pairs$p.txt" | cut -c1-200 >> "$S"
done
cat "$S"
