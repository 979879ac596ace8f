#!/usr/bin/env bash
# Twenty-eighth session: an exact-mode verify round of 80 rows (batch 16, 1 + 4) against one of
# 64 (1 + 3) under ncu (DSV4_PROFILE_VERIFY), kernels by time; then exact decode at 64, 80 and
# 128 rows timed (recorded steps up to 128 rows).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
for l in 3 4; do
  DSV4_PROFILE_VERIFY=$l EXTRA="--reserve 16x4096 --decode-fill clone --cuda-exact --verify-drafts $l" CTX=4096 \
    TAG=-v$l bash tools/device/profile.sh 4 q2 16 > /dev/null 2>&1
  echo "== exact, verify batch 16, 1 + $l rows" >> "$S"
  sed -n '/^one step/,$p' "$OUT/ncu-q2-16-v$l.txt" | head -16 >> "$S"
done
for mode in exact fast; do
  E=""; [ $mode = exact ] && E="--cuda-exact"
  timeout 200 .devbin/dsv4 bench --backend cuda --synthetic flash --layers 4 --weights q2 --contexts '' --reserve 128x4096 \
    --decode-fill clone --decode-batches 64,80,128 --decode-context 4096 --decode-tokens 16 --verify-drafts 4 $E > "$OUT/b128-$mode.txt" 2>&1
  echo "== $mode: exit $?" >> "$S"
  grep -E '^(decode|verify)' "$OUT/b128-$mode.txt" | cut -c1-150 >> "$S"
done
cat "$S"
