#!/usr/bin/env bash
# A/B of the int8 tensor-core tiles (PERF.md v14), each part with the tiles on and off
# (DSV4_X8_TILES: dense = the projections only, all = the routed experts too, off; KVARIANTS and
# SVARIANTS pick them for the kernel table and the step):
#   run(command: "bash tools/device/tiles.sh [PART...]", carry: [".devbin"])
# PARTs (default: all, in this order): kernels (the int8 kernel table at 1..64 rows, products up
# to 64 rows on the int8 path), step16 (one decode step at batch 16 of the 43-layer q2 model, two
# alternating passes, ctx CTX, default 1024), prefill (2048 tokens of the 43-layer q2 model with
# every product on the int8 path, DSV4_X8_MAX_ROWS=1000000, against the default bf16 path).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/dsv4-out}
mkdir -p "$OUT"
B=.devbin/dsv4
C=${CTX:-1024}
for part in ${*:-kernels step16 prefill}; do
    case $part in
    kernels)
        for v in ${KVARIANTS:-dense off}; do
            DSV4_X8_TILES=$v DSV4_X8_MAX_ROWS=64 timeout 240 $B bench --backend cuda --synthetic kernels \
                > "$OUT/kernels-tiles$v.txt" 2>&1
            echo "kernels tiles=$v: exit $?"
            grep -E '^int8' "$OUT/kernels-tiles$v.txt" | sed 's/ vs twin.*exact [^:]*://' | cut -c1-230
        done
        ;;
    step16)
        for pass in 1 2; do
            for v in ${SVARIANTS:-dense off all}; do
                r=$(DSV4_X8_TILES=$v timeout 150 $B bench --backend cuda --synthetic flash --layers 43 --weights q2 \
                    --contexts '' --decode-batches 16 --decode-context "$C" --decode-tokens 32 2>&1 | grep -E '^decode batch' | head -1)
                echo "pass $pass tiles=$v ${r:-no result}" | cut -c1-160
            done
        done
        ;;
    prefill)
        for v in "DSV4_X8_MAX_ROWS=1000000+DSV4_X8_TILES=all" "DSV4_X8_TILES=dense"; do
            r=$(env ${v//+/ } timeout 200 $B bench --backend cuda --synthetic flash --layers 43 --weights q2 --contexts 2048 \
                --prefill-chunk 2048 --decode-batches '' --decode-context 0 2>&1 | grep -E '^prefill' | head -2)
            echo "$v: ${r:-no result}" | cut -c1-200
        done
        ;;
    *) echo "unknown part $part" ;;
    esac
done
