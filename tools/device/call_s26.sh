#!/usr/bin/env bash
# Twenty-sixth session, call 1: the probe / LRU / path-counter change's CUDA tests, then serving
# (43 q2 layers) and fast mode at 1 / 16 / 64.
set -uo pipefail
cd "$(dirname "$0")/../.."
tar -xJf devbin.tar.xz
OUT=${OUT:-/tmp/dsv4-out}; mkdir -p "$OUT"
S=$OUT/summary.txt
for t in nonfinite cuda_graph; do
  timeout 120 .devbin/tests/$t --test-threads 1 > "$OUT/test-$t.txt" 2>&1
  echo "test $t: exit $? $(grep -E '^test result' "$OUT/test-$t.txt" | tail -1)" >> "$S"
  grep -E -A3 '^test .*FAILED|panicked' "$OUT/test-$t.txt" | head -12 >> "$S"
done
bash tools/device/run.sh serve flash-b64
