#!/usr/bin/env bash
# Twenty-eighth session: why an exact-mode step of 80 rows costs ~3x one of 64 (call s28b: a
# batch-16 verify of 1 + 4 rows 40.9 ms against 13.7 for 1 + 3, both replayed): one exact
# decode step of 64 and of 80 rows (4 q2 layers, context 4096) under ncu, kernels by time.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
for bs in 64 80; do
  EXTRA="--reserve ${bs}x4096 --decode-fill clone --cuda-exact" CTX=4096 bash tools/device/profile.sh 4 q2 $bs > /dev/null 2>&1
  echo "== exact, $bs rows" >> "$S"
  sed -n '/^one step/,$p' "$OUT/ncu-q2-$bs.txt" | head -24 >> "$S"
done
cat "$S"
