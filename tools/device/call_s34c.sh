#!/usr/bin/env bash
# Prepared in the thirty-fourth session, after call_s34a/b on the same binaries: where a 3-row
# step (a verify of 1 + 2 drafts) spends its time beyond a 1-row step's, kernel by kernel (ncu,
# 4 q2 layers, context 4096 from a clone of one prefilled sequence): PERF.md v42 Next 2.
#   run(command: "bash tools/device/call_s34c.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
nvidia-smi --query-gpu=name --format=csv,noheader >> "$S"
for b in 1 3; do
  echo "== ncu, one step of $b rows, 4 layers, context 4096" >> "$S"
  CTX=4096 EXTRA="--reserve 4x4096 --decode-fill clone" timeout 280 bash tools/device/profile.sh 4 q2 $b > /dev/null 2>&1
  sed -n '/^one step/,$p' "$OUT/ncu-q2-$b.txt" | grep -vE '^ *[0-9]+ ' | head -45 >> "$S"
done
cat "$S"
