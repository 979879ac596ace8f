#!/usr/bin/env bash
# One device session's checks and measurements, in one call (see tools/device/build.sh):
#   run(command: "bash tools/device/run.sh [quick]", carry: [".devbin"])
# Writes each part's output and a summary to $OUT (or /tmp/dsv4-out). `quick`: tests and the
# kernel bench only.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/dsv4-out}
mkdir -p "$OUT"
export DSV4_FIXTURES=$PWD/tests/fixtures/hf DSV4_DSPARK_FIXTURES=$PWD/.devbin/dspark_fixtures DSV4_BIN=$PWD/.devbin/dsv4
S=$OUT/summary.txt
: > "$S"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> "$S" 2>&1
for t in .devbin/tests/*; do
    n=$(basename "$t")
    timeout 300 "$t" --test-threads 1 > "$OUT/test-$n.txt" 2>&1
    echo "test $n: exit $? $(grep -E '^test result' "$OUT/test-$n.txt" | tail -1)" >> "$S"
    grep -E '^test .*FAILED|panicked' "$OUT/test-$n.txt" | head -5 >> "$S"
done
B=.devbin/dsv4
timeout 240 $B bench --backend cuda --synthetic kernels > "$OUT/kernels.txt" 2>&1
echo "kernels: exit $?" >> "$S"
grep -E '^ *(int8 )?[A-Za-z0-9_]+ +\[' "$OUT/kernels.txt" | cut -c1-160 >> "$S"
if [ "${1:-}" != quick ]; then
    # Batches 1 and 16 at context 4096 (16 sequences prefilled: ~70 s at today's ~900 tok/s;
    # batch 64 waits for faster prefill).
    F="bench --backend cuda --synthetic flash --layers 43 --weights q2 --reserve 16x4096 --contexts 2048 \
       --prefill-chunk 8192 --decode-batches 1,16 --decode-context 4096 --decode-tokens 16 --verify-drafts 1,2,4 --dspark-round"
    for mode in exact int8; do
        env $([ $mode = int8 ] && echo DSV4_INT8=1) timeout 420 $B $F > "$OUT/flash-q2-$mode.txt" 2>&1
        echo "flash q2 43 layers ($mode): exit $?" >> "$S"
        grep -E '^(prefill|decode|verify|dspark)' "$OUT/flash-q2-$mode.txt" | cut -c1-200 >> "$S"
    done
fi
cat "$S"
