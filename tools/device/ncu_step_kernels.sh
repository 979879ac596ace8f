#!/usr/bin/env bash
# Chosen kernels of one decode step under ncu's full section set (graph nodes profiled one by
# one, real clocks): occupancy, warp stalls, memory workload, source counters.
#   run(command: "bash tools/device/ncu_step_kernels.sh REGEX [LAYERS] [COUNT]", carry: [".devbin"])
# CTX (4096) is the decode context, BATCH (1) the rows a step; writes $OUT/ncu-step-kernels.txt (ncu's details page).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/dsv4-out}
mkdir -p "$OUT"
RE=$1 L=${2:-4} C=${3:-8} CTX=${CTX:-4096}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
DSV4_PROFILE_CAPTURE=1 timeout 240 "$NCU" --profile-from-start off --graph-profiling node --set full \
    --clock-control none -k "regex:$RE" -c "$C" \
    .devbin/dsv4 bench --backend cuda --synthetic flash --layers "$L" --weights q2 --contexts '' \
    --decode-batches "${BATCH:-1}" --decode-context "$CTX" --decode-tokens 1 > "$OUT/ncu-step-kernels.txt" 2> /tmp/ncu-sk.err
echo "ncu: exit $?"
tail -3 /tmp/ncu-sk.err
grep -E '^  [a-z_0-9]+\(|^    Duration|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|DRAM Throughput|Block Limit Reg' \
    "$OUT/ncu-step-kernels.txt" | head -80
