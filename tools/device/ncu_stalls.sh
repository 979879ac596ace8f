#!/usr/bin/env bash
# Why chosen kernels of one decode step are slow: ncu's full section set on them (graph nodes
# profiled one by one, warm caches, real clocks), then a short table a launch from the raw
# metrics (tools/ncu_stalls.py): duration, DRAM and issue use, occupancy, registers, shared
# memory bank conflicts and the largest warp stall reasons (cycles a warp between issues).
#   run(command: "BATCH=16 bash tools/device/ncu_stalls.sh REGEX [LAYERS] [COUNT]", carry: [".devbin"])
# CTX (4096) is the decode context, BATCH (1) the rows a step, EXTRA more bench arguments (as
# profile.sh's); TAG names the output
# ($OUT/stalls-$BATCH$TAG.txt).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/dsv4-out}
mkdir -p "$OUT"
RE=$1 L=${2:-4} C=${3:-4} CTX=${CTX:-4096} BS=${BATCH:-1} TAG=${TAG:-}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
R=/tmp/stalls-$BS$TAG
BATCH=$BS CTX=$CTX bash tools/device/ncu_full.sh "$RE" "$L" "$C" "$R"
"$NCU" -i "$R.ncu-rep" --page raw --csv --print-units base > "$R.csv" 2> /dev/null
cp "$R.csv" "$OUT/stalls-$BS$TAG.csv"
python3 tools/ncu_stalls.py "$R.csv" > "$OUT/stalls-$BS$TAG.txt"
cat "$OUT/stalls-$BS$TAG.txt"
