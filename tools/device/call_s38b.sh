#!/usr/bin/env bash
# Prepared in the thirty-eighth session (PERF.md v47), any GPU, ~5 minutes: X8_PF_FRONT (the
# one-row expert kernels' first blocks queue the call's routed weight planes into L2 as bulk
# prefetches) checked bitwise, then the experts table for 0 / 132 / 264 / 528 issuing blocks
# (kvar/pffN, the same quant.cu otherwise; pffNp: moe_down1s's share before its PDL wait), then batch 1 alternating pff0 and the best variant.
#   run(command: "bash tools/device/call_s38b.sh", carry: ["devbin.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/device/run_test.sh
call_start 420
export DSV4_BIN=.devbin/dsv4
for v in pff132 pff264p; do
  DSV4_CUDA_KERNELS=.devbin/kvar/$v run_test cuda_packed cuda_one_row_experts_in_two_launches_are_bitwise
done
BUDGET=$LIMIT experts_variants $T0 pff0 pff132 pff264 pff528 pff132p pff264p pff0
# The variant with the lowest one-row DRAM figure.
best=$(for v in pff132 pff264 pff528 pff132p pff264p; do
  f=$(grep -E '^experts 1 rows, dram' "$OUT/experts-$v.txt" 2>/dev/null | grep -m1 -oE '[0-9.]+ µs a call' | cut -d' ' -f1)
  [ -n "$f" ] && echo "$f $v"; done | sort -n | head -1 | cut -d' ' -f2)
best=${best:-pff132}; echo "best: $best" >> "$S"
for v in pff0 $best pff0 $best; do
  t && batch1_rounds $FL $v-$(date +%s) DSV4_CUDA_KERNELS=.devbin/kvar/$v
done
echo "total $(( $(date +%s) - T0 )) s" >> "$S"
cat "$S"
