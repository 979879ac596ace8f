#!/usr/bin/env bash
# Where inside a kernel its warps wait: ncu's per-instruction (SASS) counters and warp-state
# samples for chosen kernels of one decode step (graph nodes one by one, real clocks), as CSV
# ($OUT/source-$BATCH$TAG.csv.xz, one block of rows a launch) and a summary by tools/ncu_source.py
# (the instructions with the most stall samples, and the samples by opcode and reason).
#   run(command: "BATCH=1 bash tools/device/ncu_source.sh REGEX [LAYERS] [COUNT]", carry: [".devbin"])
# CTX (4096), BATCH (1), EXTRA and TAG as ncu_stalls.sh's.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/dsv4-out}
mkdir -p "$OUT"
RE=$1 L=${2:-4} C=${3:-1} CTX=${CTX:-4096} BS=${BATCH:-1} TAG=${TAG:-}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
R=/tmp/source-$BS$TAG
BATCH=$BS CTX=$CTX bash tools/device/ncu_full.sh "$RE" "$L" "$C" "$R" --import-source no
"$NCU" -i "$R.ncu-rep" --page source --csv --print-source sass > "$R.csv" 2> "$R.err"
echo "source page: exit $? ($(wc -l < "$R.csv") lines)"
head -3 "$R.err"
xz -9 -c "$R.csv" > "$OUT/source-$BS$TAG.csv.xz"
python3 tools/ncu_source.py "$R.csv" > "$OUT/source-$BS$TAG.txt" 2>&1
head -60 "$OUT/source-$BS$TAG.txt"
