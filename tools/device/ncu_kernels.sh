#!/usr/bin/env bash
# The kernel bench's one-row products under ncu's full section set (speed of light, memory
# workload, warp stalls, occupancy, source counters): one profiled launch per kernel and grid.
#   run(command: "bash tools/device/ncu_kernels.sh [KERNEL_REGEX]", carry: [".devbin"])
# Writes $OUT/ncu-kernels.txt (ncu's details page as text).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/dsv4-out}
mkdir -p "$OUT"
RE=${1:-'^gemv1x?_(q8_0|iq2_xxs|bf16)$'}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
timeout 300 "$NCU" --set full --filter-mode per-launch-config -c 1 -k "regex:$RE" --clock-control none \
    .devbin/dsv4 bench --backend cuda --synthetic kernels > "$OUT/ncu-kernels.txt" 2> /tmp/ncu-k.err
echo "ncu kernels: exit $?"
tail -3 /tmp/ncu-k.err
grep -E '^  [a-z_0-9]+\(|Duration|DRAM Throughput|Memory Throughput|L1/TEX Hit|L2 Hit|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issued Ipc|Mem Pipes Busy' "$OUT/ncu-kernels.txt" | head -120
